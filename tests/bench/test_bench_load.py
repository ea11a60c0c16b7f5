"""`pagedllm bench load`: its synthetic GGUF writer, read back with gguf's own reader, and its measurement
of a load in a fresh process, on a tiny synthetic model."""
from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.bench import load
from pagedllm.bench.load import llm_kwargs, measure_load
from pagedllm.bench.synthetic_gguf import SyntheticLlama, write_synthetic_gguf
from pagedllm.config import parse_memory_size
from pagedllm.entrypoints.cli import parse_args
from pagedllm.model.loader import bundled_model_path

TINY = SyntheticLlama(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                      context_length=256)
# Every block type the writer knows; K-quant rows hold whole 256-element super-blocks, hence hidden 256.
TINY_OTHER_TYPES = SyntheticLlama(hidden_size=256, intermediate_size=512, num_layers=1, num_heads=4,
                                  num_kv_heads=1, context_length=256, embedding_type=GGMLType.Q6_K,
                                  weight_type=GGMLType.Q8_0, ffn_down_type=GGMLType.Q4_K)
LLM_KWARGS = {"device": "cpu", "kv_cache_memory": "8MiB"}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Converted tokenizers of the temporary files go to a temporary cache, not the user's (the
    measuring child process inherits the variable)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def bundled_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(bundled_model_path())


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("synthetic") / "tiny.gguf", TINY)


def expected_tensors(spec: SyntheticLlama, vocab: int) -> dict[str, tuple[tuple[int, ...], GGMLType]]:
    """GGUF name -> (shape in GGUF order, columns first, type), spelled out from llama.cpp's layout."""
    hidden, inter, kv = spec.hidden_size, spec.intermediate_size, spec.num_kv_heads * spec.head_dim
    tensors = {"token_embd.weight": ((hidden, vocab), spec.embedding_type),
               "output_norm.weight": ((hidden,), GGMLType.F32)}
    for layer in range(spec.num_layers):
        block = f"blk.{layer}."
        tensors |= {
            block + "attn_norm.weight": ((hidden,), GGMLType.F32),
            block + "ffn_norm.weight": ((hidden,), GGMLType.F32),
            block + "attn_q.weight": ((hidden, hidden), spec.weight_type),
            block + "attn_k.weight": ((hidden, kv), spec.weight_type),
            block + "attn_v.weight": ((hidden, kv), spec.weight_type),
            block + "attn_output.weight": ((hidden, hidden), spec.weight_type),
            block + "ffn_gate.weight": ((hidden, inter), spec.weight_type),
            block + "ffn_up.weight": ((hidden, inter), spec.weight_type),
            block + "ffn_down.weight": ((inter, hidden), spec.ffn_down_type),
        }
    return tensors


@pytest.mark.parametrize("spec", [TINY, TINY_OTHER_TYPES], ids=["q4_0-q4_k-q8_0", "q8_0-q4_k-q6_k"])
def test_synthetic_gguf_reads_back(spec, bundled_reader, tmp_path):
    path = write_synthetic_gguf(tmp_path / "model.gguf", spec)
    reader = gguf.GGUFReader(path)
    vocab = len(bundled_reader.fields["tokenizer.ggml.tokens"].contents())

    found = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type) for t in reader.tensors}
    assert found == expected_tensors(spec, vocab)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if tensor.tensor_type == GGMLType.F32:
            assert np.all(values == 1.0), tensor.name
        else:   # random blocks with sane scales: weights of a trained model's order, never inf or NaN
            assert np.all(np.isfinite(values)), tensor.name
            assert 0.005 < values.std() < 0.05 and np.abs(values).max() < 0.5, tensor.name


def test_synthetic_gguf_metadata(tiny_gguf, bundled_reader):
    metadata = {key: field.contents() for key, field in gguf.GGUFReader(tiny_gguf).fields.items()}
    bundled = {key: field.contents() for key, field in bundled_reader.fields.items()}
    assert {key: value for key, value in metadata.items() if key.startswith("tokenizer.")} == \
           {key: value for key, value in bundled.items() if key.startswith("tokenizer.")}
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.embedding_length"] == 64
    assert metadata["llama.feed_forward_length"] == 256
    assert metadata["llama.block_count"] == 2
    assert metadata["llama.attention.head_count"] == 4
    assert metadata["llama.attention.head_count_kv"] == 2
    assert metadata["llama.rope.dimension_count"] == 16
    assert metadata["llama.vocab_size"] == len(bundled["tokenizer.ggml.tokens"])


def test_llm_loads_synthetic_gguf_as_transformers_reads_it(tiny_gguf):
    """The float path (exact) on the synthetic file against transformers' own GGUF reader, dequantizing the
    same blocks: greedy tokens equal, their log-probabilities within the suite's float32 1e-4."""
    llm = LLM(str(tiny_gguf), dtype="float32", quantization="none", **LLM_KWARGS)
    config = llm.llm_engine.model_config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (64, 2, 2)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    completion = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    reference.generation_config.eos_token_id = None
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=0)
    assert list(completion.token_ids) == expected.sequences[0, len(prompt):].tolist()
    expected_logprobs = torch.log_softmax(torch.cat(expected.logits).float(), dim=-1)
    chosen = [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)]
    torch.testing.assert_close(torch.tensor(chosen), expected_logprobs[range(4), list(completion.token_ids)],
                               atol=1e-4, rtol=0)


def storage_bytes(tensors) -> int:
    """Reference: the bytes of each distinct storage among tensors, plus those of oneDNN-prepacked
    tensors (float weights on CPUs with fast bfloat16), which have no storage."""
    tensors = list(tensors)
    prepacked = {id(t): t.nbytes for t in tensors if t.is_mkldnn}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_mkldnn}
    return sum(prepacked.values()) + sum(storages.values())


def test_measure_load_reports_the_loaded_model(tiny_gguf):
    started = time.perf_counter()
    measured = measure_load(str(tiny_gguf), LLM_KWARGS)
    whole_call = time.perf_counter() - started   # process start, imports and load: the load is a part of it

    runner = LLM(str(tiny_gguf), **LLM_KWARGS).llm_engine.runner
    # Every tensor registered on any submodule, read from the registries themselves: modules that share
    # a tensor (tied embeddings) each list it, and storage_bytes counts it once.
    registered = [tensor for module in runner.model.modules()
                  for tensor in (*module._parameters.values(), *module._buffers.values()) if tensor is not None]
    assert measured.weight_bytes == storage_bytes(registered) > 0
    caches = [cache for layer in runner.kv_caches for cache in layer]
    assert measured.kv_pool_bytes == storage_bytes([c.data for c in caches] + [c.scales for c in caches
                                                                               if c.scales is not None])
    assert 0 < measured.kv_pool_bytes <= parse_memory_size(LLM_KWARGS["kv_cache_memory"])
    assert 0 < measured.load_seconds < whole_call
    assert 0 < measured.baseline_rss <= measured.peak_rss
    assert 0 < measured.final_rss <= measured.peak_rss
    assert 0 < measured.baseline_file_rss < measured.baseline_rss and 0 < measured.final_file_rss < measured.final_rss


def test_measure_load_reports_a_failed_load(tmp_path):
    with pytest.raises(RuntimeError, match="not found"):
        measure_load(str(tmp_path / "missing.gguf"), LLM_KWARGS)


def test_cli_passes_only_the_options_given():
    """quantization in particular reaches LLM() only when asked for, so the bench runs on engines of any age."""
    args = parse_args(["bench", "load", "--synthetic-1b", "--dtype", "float32"])
    assert args.handler is load.run and args.synthetic_1b
    assert llm_kwargs(args) == {"dtype": "float32", "device": "cpu",
                                "kv_cache_memory": load.DEFAULT_KV_CACHE_MEMORY}


def test_cli_rejects_bad_options_before_loading():
    with pytest.raises(SystemExit, match="kv_cache_memory"):
        llm_kwargs(parse_args(["bench", "load", "--kv-cache-memory", "lots"]))
