"""Shared fixtures: the bundled GGUF model and its transformers reference, a saved copy of its tokenizer, tiny
random HF checkpoints, a module's server (with clients) and offline LLM; and the rule that the C++ kernels
are required where they are built."""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import httpx
import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated (when pagedllm.model.attention.triton_kernels is first
# imported), not when triton itself is: set here, before any test imports that module, it makes the Triton
# kernels run on CPU tensors in the interpreter, whoever imported triton earlier (xgrammar does). On a GPU
# it stays unset, so the same tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import (  # noqa: E402
    AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config,
    Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig,
)

from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER  # noqa: E402
from pagedllm.bench.server_process import SERVE_MODULE, ServerProcess  # noqa: E402
from pagedllm.model import kernels  # noqa: E402
from pagedllm.model.loader import bundled_model_path  # noqa: E402
from pagedllm.tokenizer import load_tokenizer_from_gguf  # noqa: E402

_TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,  # the bundled tokenizer's <|im_start|> and <|im_end|>
    eos_token_id=2,
)
# With head_dim 16 and these settings the llama3 rule leaves some frequencies alone, blends some and
# divides the rest by the factor, so all three branches are exercised.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# Phi-3's longrope: per-frequency factors (rotary_dim / 2 of them, here head_dim 32) that differ from one
# frequency to the next, the long ones past the original 128 positions.
_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(16)],
    "long_factor": [1.5 + 0.4 * i for i in range(16)],
}
# With head_dim 32 and an original context of 64, yarn's ramp runs between frequencies 2 and 6 of 16:
# some kept, some interpolated, some blended.
_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
TINY_ARCHS = {
    "llama": (LlamaConfig, {"rope_theta": 10000.0}),
    "llama3": (LlamaConfig, {"rope_theta": 10000.0, "rope_scaling": _LLAMA3_ROPE}),
    "mistral": (MistralConfig, {"head_dim": 16, "sliding_window": 4096}),
    "qwen2": (Qwen2Config, {}),
    # head_dim differs from hidden_size // num_attention_heads, as in real Qwen3 models.
    "qwen3": (Qwen3Config, {"head_dim": 32}),
    # Qwen2.5's long-context form (yarn), and Llama with dynamic NTK past a 64-token context (factor 4).
    "qwen2-yarn": (Qwen2Config, {"num_attention_heads": 2, "num_key_value_heads": 1, "rope_scaling": _YARN}),
    "llama-dynamic": (LlamaConfig, {"max_position_embeddings": 64,
                                    "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}),
    # Sliding windows shorter than most test prompts: Mistral's on every layer (blocks released as a
    # sequence grows), Qwen2's from layer max_window_layers on (a full-attention layer beside a windowed one).
    "mistral-window": (MistralConfig, {"head_dim": 16, "sliding_window": 20}),
    "qwen2-window": (Qwen2Config, {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
    # Phi-3: fused qkv_proj and gate_up_proj; Phi-4-mini's partial rotary (half of each head rotated).
    "phi3": (Phi3Config, {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    "phi3-longrope": (Phi3Config, {"num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 0,
                                   "original_max_position_embeddings": 128, "rope_scaling": _LONGROPE}),
    # Gemma: windows shorter than most test prompts beside full layers, a query_pre_attn_scalar apart from
    # head_dim, and (Gemma 2) soft-caps below the scores' and logits' spread, so that capping changes them.
    "gemma2": (Gemma2Config, {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 20,
                              "num_hidden_layers": 3, "attn_logit_softcapping": 1.5,
                              "final_logit_softcapping": 2.0}),
    # Gemma 3: q/k norms; local layers rotating at their own base, the global one with linear scaling.
    "gemma3": (Gemma3TextConfig, {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 20,
                                  "num_hidden_layers": 3,
                                  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                  "rope_parameters": {
                                      "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    # Mixtures of 8 experts, 2 per token: Mixtral renormalises the top 2 (softmax over their logits);
    # Qwen2-MoE leaves them unnormalised, adds its sigmoid-gated shared expert, and keeps layer 1 dense
    # (mlp_only_layers); Qwen3-MoE renormalises and routes every second layer (decoder_sparse_step 2).
    "mixtral": (MixtralConfig, {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "mixtral-window": (MixtralConfig, {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                                       "sliding_window": 20}),
    "qwen2moe": (Qwen2MoeConfig, {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                  "mlp_only_layers": [1]}),
    # Qwen2-MoE's own window pattern: every other layer below max_window_layers (layer 0 here).
    "qwen2moe-window": (Qwen2MoeConfig, {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                                         "use_sliding_window": True, "sliding_window": 20, "max_window_layers": 2}),
    "qwen3moe": (Qwen3MoeConfig, {"head_dim": 32, "num_hidden_layers": 4, "num_experts": 8,
                                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                                  "decoder_sparse_step": 2}),
    "qwen3moe-window": (Qwen3MoeConfig, {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                         "moe_intermediate_size": 32, "use_sliding_window": True,
                                         "sliding_window": 20}),
}


def pytest_sessionstart(session):
    """Where setup.py builds the C++ kernels, a missing build fails the run instead of skipping every kernel test."""
    if kernels.BUILD_REQUIRED and kernels.kernels is None:
        pytest.exit("pagedllm's C++ kernels are not built on this x86-64 machine: run "
                    "`python setup.py build_ext --inplace` (or `pip install -e .`)", returncode=1)


def pytest_collection_modifyitems(items):
    """Tests marked `kernels` need the C++ build: they skip only where it is optional (not x86-64)."""
    if kernels.kernels is None:
        skip = pytest.mark.skip(reason=f"C++ kernels not built ({platform.machine()}: optional there)")
        for item in items:
            if item.get_closest_marker("kernels"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def bundled_gguf_path() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="session")
def bundled_reference(bundled_gguf_path):
    """transformers' own model of the bundled GGUF, in float32 on its weights as gguf dequantizes them: the
    independent reference for the bundled model."""
    return AutoModelForCausalLM.from_pretrained(bundled_gguf_path.parent, gguf_file=bundled_gguf_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer_dir(bundled_gguf_path, tmp_path_factory) -> Path:
    """The bundled model's tokenizer saved as tokenizer.json & co, to drop into HF checkpoint folders."""
    folder = tmp_path_factory.mktemp("bundled-tokenizer")
    load_tokenizer_from_gguf(bundled_gguf_path).hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def make_tiny_model_dir(hf_tokenizer_dir):
    """Factory: make_tiny_model_dir(tmp_path, arch, *, dtype=torch.float32, max_shard_size=None,
    **config_overrides) saves a seeded random model of arch (a TINY_ARCHS key) with the bundled tokenizer
    and returns the folder."""

    def make(tmp_path: Path, arch: str, *, dtype=torch.float32, max_shard_size=None, **overrides) -> Path:
        config_class, arch_settings = TINY_ARCHS[arch]
        config = config_class(**{**_TINY_SHAPE, **arch_settings, **overrides})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            # Default init leaves norms at one and biases at zero: that would hide an unused norm or bias.
            for name, param in model.named_parameters():
                param.normal_(mean=1.0 if "norm" in name else 0.0, std=0.1)
        folder = tmp_path / f"tiny-{arch}"
        sharding = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.to(dtype).save_pretrained(folder, **sharding)
        for file in hf_tokenizer_dir.iterdir():
            shutil.copy(file, folder / file.name)
        return folder

    return make


CLIENT_TIMEOUT = 300   # seconds: a request that never answers fails its test instead of hanging the suite


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """The module's own `pagedllm serve` on loopback, started with its SERVER_FLAGS (and --api-key
    SERVER_API_KEY where it sets one; the fault-injection launcher where SERVER_FAULT_INJECTION is true),
    stopped when the module ends."""
    module = request.module
    process = ServerProcess(tmp_path_factory.mktemp(module.__name__.rpartition(".")[2]) / "server.log",
                            *module.SERVER_FLAGS, api_key=getattr(module, "SERVER_API_KEY", None),
                            launcher=FAULT_INJECTION_LAUNCHER if getattr(module, "SERVER_FAULT_INJECTION", False)
                            else SERVE_MODULE)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    """The official openai client on the module's server."""
    return server.openai_client(CLIENT_TIMEOUT)


@pytest.fixture(scope="module")
def http(server):
    """Raw HTTP to the module's server, with its API key."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=CLIENT_TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def llm(request):
    """The module's offline LLM, built with its LLM_SETTINGS."""
    from pagedllm import LLM

    return LLM(**request.module.LLM_SETTINGS)


@pytest.fixture
def fail_request_at(monkeypatch):
    """fail_request_at(request_id, num_output_tokens): the engine's per-request token processing raises
    for that request once it holds that many output tokens; every other request is untouched."""
    from pagedllm.engine import output_processor

    def install(request_id: str, num_output_tokens: int) -> None:
        real_process_token = output_processor.process_token

        def process_token(child, *args):
            request = child.request
            if request.request_id == request_id and request.num_output_tokens == num_output_tokens:
                raise RuntimeError("injected failure")
            return real_process_token(child, *args)

        monkeypatch.setattr(output_processor, "process_token", process_token)

    return install
