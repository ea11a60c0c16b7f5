"""The pooling routes of a real `pagedllm serve` on loopback: /v1/embeddings through the official openai client,
/v1/score and /v1/rerank against sentence-transformers, and the 400s that name the field at fault."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from pooling_checkpoints import DOCUMENTS, QUERY, cross_encoder_folder, qwen3_model_folder, save_sentence_transformer
from sentence_transformers import CrossEncoder, SentenceTransformer

from pagedllm.bench.server_process import ServerProcess

TOLERANCE = 1e-5   # as tests/model/test_pooling.py: float32 on both sides
FLAGS = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--served-model-name", "tiny")
TEXTS = ["the cat sat on the mat", "blue sky and sea", "a dog runs"]


@pytest.fixture(scope="module")
def embedder_folder(tmp_path_factory, hf_tokenizer_dir):
    folder = tmp_path_factory.mktemp("embedder")
    return save_sentence_transformer(qwen3_model_folder(folder / "qwen3", hf_tokenizer_dir), folder / "st", "lasttoken")


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, embedder_folder):
    server = ServerProcess(tmp_path_factory.mktemp("logs") / "embedder.log", str(embedder_folder), *FLAGS,
                           "--hf-overrides", '{"is_matryoshka": true}')
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory, hf_tokenizer_dir):
    return cross_encoder_folder(tmp_path_factory.mktemp("reranker"), "bert", hf_tokenizer_dir)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, reranker_folder):
    server = ServerProcess(tmp_path_factory.mktemp("logs") / "reranker.log", str(reranker_folder), *FLAGS)
    yield server
    server.stop()


def test_openai_client_embeddings_equal_sentence_transformers(embedder, embedder_folder):
    reference = SentenceTransformer(str(embedder_folder), device="cpu")
    expected = reference.encode(TEXTS, batch_size=len(TEXTS))
    client = embedder.openai_client()
    # The client asks for base64 unless told otherwise, and decodes it; float is the JSON list itself.
    for encoding_format in (openai.NOT_GIVEN, "float"):
        response = client.embeddings.create(model="tiny", input=TEXTS, encoding_format=encoding_format)
        assert [item.index for item in response.data] == [0, 1, 2]
        np.testing.assert_allclose([item.embedding for item in response.data], expected, atol=TOLERANCE, rtol=0)
    token_counts = [len(reference.tokenizer(text)["input_ids"]) for text in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(token_counts)
    one = client.embeddings.create(model="tiny", input=TEXTS[0])
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=TOLERANCE, rtol=0)
    ids = reference.tokenizer(TEXTS[1])["input_ids"]
    by_ids = client.embeddings.create(model="tiny", input=[ids, reference.tokenizer(TEXTS[2])["input_ids"]])
    np.testing.assert_allclose([item.embedding for item in by_ids.data], expected[1:], atol=TOLERANCE, rtol=0)
    single_ids = client.embeddings.create(model="tiny", input=ids)
    np.testing.assert_allclose(single_ids.data[0].embedding, expected[1], atol=TOLERANCE, rtol=0)


def test_dimensions_and_raw_base64(embedder, embedder_folder):
    truncated = SentenceTransformer(str(embedder_folder), device="cpu", truncate_dim=8).encode(TEXTS[:1])[0]
    client = embedder.openai_client()
    response = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=8)
    np.testing.assert_allclose(response.data[0].embedding, truncated / np.linalg.norm(truncated), atol=TOLERANCE,
                               rtol=0)
    raw = httpx.post(f"{embedder.url}/v1/embeddings", timeout=60,
                     json={"input": TEXTS[0], "encoding_format": "base64", "dimensions": 8}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(response.data[0].embedding, dtype=np.float32))
    assert raw["object"] == "list" and raw["data"][0]["object"] == "embedding" and raw["model"] == "tiny"


@pytest.mark.parametrize("body, param, message", [
    ({"input": ""}, "input", "input must not be empty"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ["a", ""]}, "input", "input must not be empty"),
    ({"input": 5}, "input", None),
    ({"input": ["a", 5]}, "input", None),
    ({"input": [True]}, "input", None),
    ({"input": [10**9]}, "input", "prompt_token_ids must be a list of integers in [0, 49152)"),
    ({"input": "a", "dimensions": 0}, "dimensions", "dimensions must be an integer >= 1, got 0"),
    ({"input": "a", "dimensions": 65}, "dimensions", "dimensions must be in [1, 64], got 65"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "prompts are never truncated"),
    ({"input": "a", "model": "other"}, "model", "does not exist"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(embedder, body, param, message):
    response = httpx.post(f"{embedder.url}/v1/embeddings", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param
    assert message is None or message in error["message"]


def test_embedding_model_scores_and_reranks_by_cosine(embedder, embedder_folder):
    reference = SentenceTransformer(str(embedder_folder), device="cpu")
    expected = reference.similarity(reference.encode([QUERY]), reference.encode(DOCUMENTS))[0].numpy()
    scores = httpx.post(f"{embedder.url}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    np.testing.assert_allclose([item["score"] for item in scores["data"]], expected, atol=TOLERANCE, rtol=0)
    ranked = httpx.post(f"{embedder.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    assert [result["index"] for result in ranked["results"]] == np.argsort(-expected, kind="stable").tolist()


def test_cross_encoder_score_and_rerank_equal_sentence_transformers(reranker, reranker_folder):
    expected = CrossEncoder(str(reranker_folder), device="cpu").predict([(QUERY, document) for document in DOCUMENTS])
    order = np.argsort(-expected, kind="stable").tolist()
    assert len(set(np.round(expected, 4))) == len(DOCUMENTS), "the random model should tell the documents apart"
    scores = httpx.post(f"{reranker.url}/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
    assert [item["index"] for item in scores["data"]] == list(range(len(DOCUMENTS)))
    np.testing.assert_allclose([item["score"] for item in scores["data"]], expected, atol=TOLERANCE, rtol=0)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        ranked = httpx.post(f"{reranker.url}{path}", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3},
                            timeout=60).json()
        assert [result["index"] for result in ranked["results"]] == order[:3]
        assert [result["document"]["text"] for result in ranked["results"]] == [DOCUMENTS[i] for i in order[:3]]
        np.testing.assert_allclose([result["relevance_score"] for result in ranked["results"]], expected[order[:3]],
                                   atol=TOLERANCE, rtol=0)
    every = httpx.post(f"{reranker.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    assert [result["index"] for result in every["results"]] == order
    tokenizer = CrossEncoder(str(reranker_folder), device="cpu").tokenizer
    assert every["usage"]["total_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "query must be a non-empty string"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "documents must be a non-empty string or"),
    ("/v1/rerank", {"query": "q", "documents": "a"}, "documents", None),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "top_n must be >= 0"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_2", "text_2 must have as many texts as text_1"),
    ("/v1/embeddings", {"input": "a"}, "model", "task embed is not supported by this model: it is a cross-encoder"),
])
def test_bad_score_requests_are_400s_naming_the_field(reranker, path, body, param, message):
    response = httpx.post(f"{reranker.url}{path}", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400, error
    assert error["param"] == param
    assert message is None or message in error["message"]


def test_generative_model_refuses_pooling_routes(tmp_path, make_tiny_model_dir):
    server = ServerProcess(tmp_path / "generator.log", str(make_tiny_model_dir(tmp_path, "llama")), *FLAGS)
    try:
        for path, body in (("/v1/embeddings", {"input": "hi"}), ("/v1/rerank", {"query": "q", "documents": ["d"]}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"})):
            response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "model"
            assert "needs a pooling model" in response.json()["error"]["message"]
    finally:
        server.stop()
