"""Pooling models (vLLM's pooling runner) against sentence-transformers, on tiny random checkpoints written here.

Tolerance: the embeddings are unit vectors (or pooled states of a few hundred float32 values) computed by
the same float32 ops in another order; float32's rounding (~6e-8 relative) over the few hundred terms of a
dot product and a few layers stays near 1e-6, so 1e-5 (the issue's bound) holds with room.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from pooling_checkpoints import (DOCUMENTS, QUERY, WORDS, cross_encoder_folder, encoder_model_folder,
                                 qwen3_model_folder, save_sentence_transformer)
from sentence_transformers import CrossEncoder, SentenceTransformer

from pagedllm import LLM, PoolingParams

TOLERANCE = 1e-5
KV = "64MiB"
TEXTS = ["the cat sat on the mat", "paged attention keeps the cache in blocks", "a dog runs",
         "red green blue sky and sea", "write the book, read the book, rank the book", "token"]


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> Path:
    return encoder_model_folder(tmp_path_factory.mktemp("bert"), "bert")


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory, hf_tokenizer_dir) -> Path:
    return qwen3_model_folder(tmp_path_factory.mktemp("qwen3"), hf_tokenizer_dir)


def reference_embeddings(folder: Path) -> np.ndarray:
    model = SentenceTransformer(str(folder), device="cpu")
    return model.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))


def our_embeddings(llm: LLM, params: PoolingParams | None = None) -> np.ndarray:
    return np.array([output.outputs.embedding for output in llm.embed(TEXTS, params, use_tqdm=False)])


@pytest.mark.parametrize("pooling_mode", ["mean", "cls"])
def test_bert_embeddings_equal_sentence_transformers(bert_folder, tmp_path, pooling_mode):
    folder = save_sentence_transformer(bert_folder, tmp_path / "st", pooling_mode)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV)
    np.testing.assert_allclose(our_embeddings(llm), reference_embeddings(folder), atol=TOLERANCE, rtol=0)


def test_xlm_roberta_embeddings_equal_sentence_transformers(tmp_path):
    folder = save_sentence_transformer(encoder_model_folder(tmp_path / "xlmr", "xlm-roberta"), tmp_path / "st", "mean")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV)
    np.testing.assert_allclose(our_embeddings(llm), reference_embeddings(folder), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("pooling_mode", ["lasttoken", "mean"])
def test_qwen3_embeddings_equal_sentence_transformers(qwen3_folder, tmp_path, pooling_mode):
    folder = save_sentence_transformer(qwen3_folder, tmp_path / "st", pooling_mode)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV)
    np.testing.assert_allclose(our_embeddings(llm), reference_embeddings(folder), atol=TOLERANCE, rtol=0)


def test_pooling_flag_overrides_the_checkpoint(bert_folder, tmp_path):
    """--pooling (vLLM: pooler_config) wins over 1_Pooling/config.json: a mean checkpoint pooled by CLS equals
    the CLS checkpoint."""
    mean_folder = save_sentence_transformer(bert_folder, tmp_path / "mean", "mean")
    cls_folder = save_sentence_transformer(bert_folder, tmp_path / "cls", "cls")
    short = LLM(str(mean_folder), dtype="float32", kv_cache_memory=KV, pooling="cls")
    np.testing.assert_allclose(our_embeddings(short), reference_embeddings(cls_folder), atol=TOLERANCE, rtol=0)
    vllm_name = LLM(str(mean_folder), dtype="float32", kv_cache_memory=KV, pooler_config={"pooling_type": "CLS"})
    np.testing.assert_allclose(our_embeddings(vllm_name), reference_embeddings(cls_folder), atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="pooling 'cls' contradicts pooler_config's pooling_type 'MEAN'"):
        LLM(str(mean_folder), pooling="cls", pooler_config={"pooling_type": "mean"})


def test_matryoshka_dimensions_truncate_then_normalise(qwen3_folder, tmp_path):
    folder = save_sentence_transformer(qwen3_folder, tmp_path / "st", "lasttoken")
    full = reference_embeddings(folder)
    truncated = SentenceTransformer(str(folder), device="cpu", truncate_dim=16).encode(TEXTS, batch_size=len(TEXTS))
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV, hf_overrides={"is_matryoshka": True})
    np.testing.assert_allclose(our_embeddings(llm, PoolingParams(dimensions=16)),
                               truncated / np.linalg.norm(truncated, axis=1, keepdims=True), atol=TOLERANCE, rtol=0)
    raw = our_embeddings(llm, PoolingParams(normalize=False))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), full, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 64\], got 65"):
        llm.embed("x", PoolingParams(dimensions=65))
    plain = LLM(str(folder), dtype="float32", kv_cache_memory=KV)
    with pytest.raises(ValueError, match="dimensions is not supported by this model"):
        plain.embed("x", PoolingParams(dimensions=16))


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen3"])
def test_cross_encoder_scores_equal_sentence_transformers(tmp_path, hf_tokenizer_dir, family):
    folder = cross_encoder_folder(tmp_path, family, hf_tokenizer_dir)
    reference = CrossEncoder(str(folder), device="cpu").predict([(QUERY, document) for document in DOCUMENTS])
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV)
    scores = [output.outputs.score for output in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(scores, reference, atol=TOLERANCE, rtol=0)
    assert len(set(np.round(scores, 4))) == len(DOCUMENTS), "the random model should tell the documents apart"
    pairwise = llm.score([QUERY, DOCUMENTS[0]], [DOCUMENTS[1], DOCUMENTS[2]], use_tqdm=False)
    expected = CrossEncoder(str(folder), device="cpu").predict([(QUERY, DOCUMENTS[1]), (DOCUMENTS[0], DOCUMENTS[2])])
    np.testing.assert_allclose([output.outputs.score for output in pairwise], expected, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="task embed is not supported by this model: it is a cross-encoder"):
        llm.embed("x")


def test_cross_encoder_saved_with_its_activation(tmp_path, hf_tokenizer_dir):
    """A CrossEncoder saved with activation_fn Identity scores by the raw logit, as CrossEncoder does."""
    reference = CrossEncoder(str(cross_encoder_folder(tmp_path, "bert", hf_tokenizer_dir)), device="cpu",
                             activation_fn=torch.nn.Identity())
    reference.save(str(tmp_path / "saved"))
    expected = reference.predict([(QUERY, document) for document in DOCUMENTS])
    assert (expected < 0).any() or (expected > 1).any(), "raw logits, not probabilities"
    llm = LLM(str(tmp_path / "saved"), dtype="float32", kv_cache_memory=KV)
    scores = [output.outputs.score for output in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    np.testing.assert_allclose(scores, expected, atol=TOLERANCE, rtol=0)


def test_embedding_model_scores_by_cosine(bert_folder, tmp_path):
    folder = save_sentence_transformer(bert_folder, tmp_path / "st", "mean")
    reference = SentenceTransformer(str(folder), device="cpu")
    expected = reference.similarity(reference.encode([QUERY]), reference.encode(DOCUMENTS))[0].numpy()
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV)
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    np.testing.assert_allclose([output.outputs.score for output in outputs], expected, atol=TOLERANCE, rtol=0)
    query_ids = llm.get_tokenizer().encode(QUERY)
    assert outputs[1].prompt_token_ids == query_ids + llm.get_tokenizer().encode(DOCUMENTS[1])


def test_pooling_requests_hold_kv_only_for_their_step(bert_folder, tmp_path):
    """They share the scheduler and the KV pool: blocks are allocated when a prompt is scheduled (whole, in one
    step) and all are free again once that step has pooled it."""
    folder = save_sentence_transformer(bert_folder, tmp_path / "st", "mean")
    engine = LLM(str(folder), dtype="float32", kv_cache_memory=KV, block_size=8).llm_engine
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(text) for text in TEXTS]
    for index, ids in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": ids}, PoolingParams())
    pool = engine.kv_manager.pool
    scheduled = engine.scheduler.schedule()
    assert scheduled.num_scheduled_tokens == {str(i): len(ids) for i, ids in enumerate(prompts)}
    assert pool.num_blocks - pool.num_free_blocks == sum(-(-len(ids) // 8) for ids in prompts)
    runner_output = engine.executor.execute_model(scheduled)
    engine.scheduler.update_from_output(scheduled, runner_output)
    assert pool.num_free_blocks == pool.num_blocks and not engine.scheduler.requests
    assert sorted(runner_output.pooler_output) == sorted(map(str, range(len(prompts))))


def test_encoder_prompts_are_never_chunked(bert_folder, tmp_path):
    folder = save_sentence_transformer(bert_folder, tmp_path / "st", "mean")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(16\) must be >= max_model_len \(128\) for a "
                                         r"pooling model \(its prompts run whole\)"):
        LLM(str(folder), kv_cache_memory=KV, max_num_batched_tokens=16)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory=KV, max_model_len=32, max_num_batched_tokens=32)
    long_text = " ".join(WORDS)[:200]
    ids = llm.get_tokenizer().encode(long_text)[:32]
    assert len(ids) == 32
    embedded = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
    model = SentenceTransformer(str(folder), device="cpu")
    features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, 32, dtype=torch.int64),
                "token_type_ids": torch.zeros(1, 32, dtype=torch.int64)}
    with torch.no_grad():
        expected = model(features)["sentence_embedding"][0].numpy()
    np.testing.assert_allclose(embedded, expected, atol=TOLERANCE, rtol=0)
    with pytest.raises(ValueError, match="the prompt has 33 tokens but max_model_len is 32"):
        llm.embed({"prompt_token_ids": ids + ids[:1]})


def test_wrong_model_kind_and_bad_input_are_refused(bert_folder, tmp_path, make_tiny_model_dir):
    generator = LLM(str(make_tiny_model_dir(tmp_path, "llama")), kv_cache_memory=KV)
    with pytest.raises(ValueError, match="task embed needs a pooling model"):
        generator.embed("hello")
    with pytest.raises(ValueError, match="task score needs a pooling model"):
        generator.score("a", "b")
    embedder = LLM(str(save_sentence_transformer(bert_folder, tmp_path / "st", "mean")), kv_cache_memory=KV)
    with pytest.raises(ValueError, match="this is a pooling model"):
        embedder.generate("hello")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        embedder.embed({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="data_2 must be a non-empty string or a non-empty list"):
        embedder.score("a", [])
    with pytest.raises(ValueError, match=r"token_type_ids must be a list of 2 integers \(one per token\) in \[0, 2\)"):
        embedder.embed({"prompt_token_ids": [5, 6], "token_type_ids": [0, 2]})
    with pytest.raises(ValueError, match="dimensions must be an integer >= 1, got 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="runner 'generate' cannot run BertModel"):
        LLM(str(bert_folder), runner="generate")
