"""The model facts the engine needs, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.model.moe_config import MoeConfig, moe_config_from_gguf, moe_config_from_hf
from pagedllm.model.rope_scaling import context_length, resolve_rope_scaling

HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
}
# llama.cpp names Mistral and Mixtral models "llama" too: they compute the same thing (Mixtral with experts).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
# Gemma 2 and 3: GeGLU, the embedding scaled by sqrt(hidden_size), norms on the attention and MLP outputs too.
_GEMMA = ("gemma2", "gemma3")
# Which layers slide when a checkpoint does not list them: every `pattern`-th layer attends to all keys
# (transformers' sliding_window_pattern, llama.cpp's swa pattern); Gemma 3's local layers rotate at base 10000.
_SLIDING_WINDOW_PATTERNS = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
# llama.cpp scales Gemma's attention by head_dim ** -0.5, but for the 27B models (told by their layer
# count) by (hidden_size / num_attention_heads) ** -0.5, their query_pre_attn_scalar; GGUF has no key for it.
_GGUF_27B_LAYER_COUNTS = {"gemma2": 46, "gemma3": 62}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
_LAYER_TYPES = frozenset({"sliding_attention", "full_attention"})
# llama.cpp's general.file_type values for unquantized files; quantized files have no natural dtype.
_GGUF_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters shared by every loader and the model code."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int   # the leading dimensions of each head that rope rotates
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None   # resolve_rope_scaling's form
    max_position_embeddings: int
    # Per layer: its sliding window (a token sees its last `window` keys, itself included), None for full attention.
    layer_windows: tuple[int | None, ...]
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_activation: str = "silu"          # the MLP's gate activation, transformers' name (ACTIVATIONS)
    embedding_multiplier: float = 1.0        # the token embedding is scaled by this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False             # RMSNorm on the attention and MLP outputs too (Gemma 2/3)
    query_pre_attn_scalar: float | None = None   # the attention scale is its ** -0.5 (None: head_dim's)
    attn_logit_softcapping: float | None = None    # scores become cap * tanh(score / cap)
    final_logit_softcapping: float | None = None   # logits likewise
    local_rope_theta: float | None = None    # the sliding layers' own rope base, unscaled (Gemma 3); None: shared
    moe: MoeConfig | None = None   # the experts of a mixture-of-experts model

    @property
    def context_length(self) -> int:
        """The longest sequence the model serves (max_model_len's limit)."""
        return context_length(self.max_position_embeddings, self.rope_scaling)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def uses_local_rope(self, layer: int) -> bool:
        """Whether the layer rotates by local_rope_theta: Gemma 3's sliding layers (by their configured kind,
        even where the window covers the whole context)."""
        return self.local_rope_theta is not None and self.layer_windows[layer] is not None

    def windows_within(self, max_model_len: int) -> tuple[int | None, ...]:
        """layer_windows with windows that cover every sequence up to max_model_len as None (full attention)."""
        return tuple(None if window is None or window >= max_model_len else window for window in self.layer_windows)


def kv_release_window(configs: Iterable[ModelConfig], max_model_len: int) -> int | None:
    """The window outside which a sequence's KV blocks may be given back: the widest window, when every
    layer of every model reading the KV pool (target and draft) has one; None otherwise."""
    windows = [window for config in configs for window in config.windows_within(max_model_len)]
    return None if not windows or None in windows else max(windows)


def model_config_from_hf(config: dict, generation_config: dict | None) -> ModelConfig:
    """Build a ModelConfig from config.json (transformers 4 or 5 layout) and generation_config.json."""
    architecture = _hf_architecture(config)
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an encoder such as EmbeddingGemma) is not supported: "
                         "pagedllm runs Gemma as a causal decoder")
    rope, local_rope_theta = _hf_rope_by_layer_kind(config, architecture)
    rope_theta = (rope or {}).get("rope_theta", config.get("rope_theta", 10000.0))
    hidden_size = config["hidden_size"]
    num_attention_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden_size // num_attention_heads
    partial_rotary_factor = (rope or {}).get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0
    return ModelConfig(
        architecture=architecture,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_attention_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_attention_heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial_rotary_factor),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=resolve_rope_scaling(rope, config["max_position_embeddings"],
                                          config.get("original_max_position_embeddings")),
        max_position_embeddings=config["max_position_embeddings"],
        layer_windows=_hf_layer_windows(config, architecture),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases, and its configs do not say so; Qwen2-MoE's may (qkv_bias).
        attention_bias=(architecture == "qwen2" or bool(config.get("attention_bias", False))
                        or (architecture == "qwen2moe" and config.get("qkv_bias", True))),
        qk_norm=architecture in ("qwen3", "qwen3moe", "gemma3"),
        torch_dtype=config.get("dtype") or config.get("torch_dtype"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_ordered_union(
            _as_ids(config.get("eos_token_id")), _as_ids((generation_config or {}).get("eos_token_id"))
        ),
        hidden_activation=_activation(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
        embedding_multiplier=hidden_size ** 0.5 if architecture in _GEMMA else 1.0,
        sandwich_norms=architecture in _GEMMA,
        query_pre_attn_scalar=config.get("query_pre_attn_scalar"),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        local_rope_theta=local_rope_theta,
        moe=moe_config_from_hf(config, architecture),
    )


def model_config_from_gguf(metadata: Mapping[str, Any], tensor_names: Collection[str],
                           rope_factors: Mapping[str, list[float]] | None = None) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values; tensor_names settle what metadata does not record
    (tied embeddings, q/k/v biases, q/k norms); rope_factors: the long and short factors of a longrope
    model, which llama.cpp stores as tensors (rope_factors_long/short)."""
    architecture = metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {architecture!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "This GGUF stores its rope scaling as a rope_freqs tensor (Llama 3.1 style), which pagedllm "
            "does not read; load the model's Hugging Face safetensors folder instead"
        )

    def required(key: str) -> Any:
        name = f"{architecture}.{key}"
        if name not in metadata:
            raise ValueError(f"GGUF metadata lacks {name!r}")
        return metadata[name]

    def optional(key: str, default: Any) -> Any:
        return metadata.get(f"{architecture}.{key}", default)

    hidden_size = required("embedding_length")
    num_attention_heads = required("attention.head_count")
    head_dim = optional("attention.key_length", hidden_size // num_attention_heads)
    max_position_embeddings = required("context_length")
    num_layers = required("block_count")
    return ModelConfig(
        architecture=architecture,
        vocab_size=optional("vocab_size", None) or len(metadata["tokenizer.ggml.tokens"]),
        hidden_size=hidden_size,
        intermediate_size=required("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=optional("attention.head_count_kv", num_attention_heads),
        head_dim=head_dim,
        rotary_dim=optional("rope.dimension_count", head_dim),
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        rope_theta=float(optional("rope.freq_base", 10000.0)),
        rope_scaling=resolve_rope_scaling(_gguf_rope_scaling(optional, rope_factors), max_position_embeddings),
        max_position_embeddings=max_position_embeddings,
        layer_windows=_gguf_layer_windows(architecture, optional, num_layers),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        torch_dtype=_GGUF_FILE_TYPE_DTYPES.get(metadata.get("general.file_type")),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        # llama.cpp stops at end-of-text, end-of-turn and end-of-message tokens alike.
        eos_token_ids=_ordered_union(
            *(_as_ids(metadata.get(f"tokenizer.ggml.{kind}_token_id")) for kind in ("eos", "eot", "eom"))
        ),
        # llama.cpp's Gemma graphs use tanh-approximated GELU; its converter stores Gemma's norms with the +1 added.
        hidden_activation="gelu_pytorch_tanh" if architecture in _GEMMA else "silu",
        embedding_multiplier=hidden_size ** 0.5 if architecture in _GEMMA else 1.0,
        sandwich_norms=architecture in _GEMMA,
        query_pre_attn_scalar=_gguf_query_pre_attn_scalar(architecture, optional, required("block_count"),
                                                          hidden_size / num_attention_heads),
        attn_logit_softcapping=optional("attn_logit_softcapping", None),
        final_logit_softcapping=optional("final_logit_softcapping", None),
        local_rope_theta=(float(optional("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
                          if architecture == "gemma3" else None),
        moe=moe_config_from_gguf(architecture, optional, tensor_names, num_layers, required("feed_forward_length")),
    )


def _gguf_layer_windows(architecture: str, optional: Callable[[str, Any], Any], num_layers: int
                        ) -> tuple[int | None, ...]:
    """llama.cpp's sliding window: on every layer (Phi-3; none stored for Mistral), or for Gemma on the layers
    that attention.sliding_window_pattern marks (a period, or a flag per layer; by default Gemma 2 slides
    every other layer, Gemma 3 five of six)."""
    window = optional("attention.sliding_window", None) or None
    if window is None or architecture not in _SLIDING_WINDOW_PATTERNS:
        return (window,) * num_layers
    pattern = optional("attention.sliding_window_pattern", _SLIDING_WINDOW_PATTERNS[architecture])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"{architecture}.attention.sliding_window_pattern must flag {num_layers} layers, "
                             f"got {len(pattern)}")
        return tuple(window if sliding else None for sliding in pattern)
    return tuple(window if _layer_kind(layer, pattern) == "sliding_attention" else None for layer in range(num_layers))


def _gguf_query_pre_attn_scalar(architecture: str, optional: Callable[[str, Any], Any], num_layers: int,
                                hidden_per_head: float) -> float | None:
    """attention.scale where the file has it; for Gemma otherwise llama.cpp's rule (_GGUF_27B_LAYER_COUNTS)."""
    scale = optional("attention.scale", None)
    if scale is not None:
        return float(scale) ** -2
    if _GGUF_27B_LAYER_COUNTS.get(architecture) == num_layers:
        return hidden_per_head
    return None


def _gguf_rope_scaling(optional: Callable[[str, Any], Any], rope_factors: Mapping[str, list[float]] | None
                       ) -> dict:
    """llama.cpp's rope keys in HF form. A longrope model (Phi-3) is told by its factor tensors, with the
    attention factor its converter computed; the other kinds by rope.scaling.type."""
    original = optional("rope.scaling.original_context_length", None)
    if rope_factors:
        return {"rope_type": "longrope", **rope_factors, "original_max_position_embeddings": original,
                "attention_factor": optional("rope.scaling.attn_factor", None)}
    scaling_type = optional("rope.scaling.type", "none")   # llama.cpp says "none" where HF says "default"
    return {
        "rope_type": "default" if scaling_type == "none" else scaling_type,
        "factor": optional("rope.scaling.factor", None),
        "original_max_position_embeddings": original,
        "beta_fast": optional("rope.scaling.yarn_beta_fast", None),
        "beta_slow": optional("rope.scaling.yarn_beta_slow", None),
    }


def _hf_rope_by_layer_kind(config: Mapping[str, Any], architecture: str) -> tuple[dict | None, float | None]:
    """The rope parameters of the full-attention layers, and the sliding layers' own base where they have one
    (Gemma 3: `rope_parameters` per layer kind in transformers 5, `rope_local_base_freq` beside the global
    `rope_theta` and `rope_scaling` before). transformers 5 keeps rope_theta inside rope_parameters; older
    configs keep it beside rope_scaling."""
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    if architecture != "gemma3":
        return rope, None
    local = {"rope_theta": config.get("rope_local_base_freq", _GEMMA3_LOCAL_ROPE_THETA)}
    if rope and "full_attention" in rope:
        rope, local = rope["full_attention"], rope.get("sliding_attention") or local
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention: only rope_type 'default' is supported for the "
                         f"sliding layers, got {local['rope_type']!r}")
    return rope, float(local.get("rope_theta", _GEMMA3_LOCAL_ROPE_THETA))


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_activation must be one of {', '.join(ACTIVATIONS)}, got {name!r}")
    return name


def _hf_layer_windows(config: Mapping[str, Any], architecture: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers applies it: `layer_types` where the config lists them;
    otherwise Mistral, Phi-3 and Qwen3-MoE (with use_sliding_window) window every layer, Qwen2 (with
    use_sliding_window) the layers from max_window_layers on, Qwen2-MoE every other layer below it, and Gemma
    all but every sliding_window_pattern-th."""
    num_layers = config["num_hidden_layers"]
    window = config.get("sliding_window")
    if architecture in ("qwen2", "qwen2moe", "qwen3moe") and not config.get("use_sliding_window", False):
        window = None
    if not window:
        return (None,) * num_layers
    kinds = config.get("layer_types")
    if kinds is None and architecture == "qwen2":
        first = config.get("max_window_layers", num_layers)
        kinds = ["sliding_attention" if layer >= first else "full_attention" for layer in range(num_layers)]
    if kinds is None and architecture in _SLIDING_WINDOW_PATTERNS:
        pattern = _SLIDING_WINDOW_PATTERNS[architecture]   # transformers reads a config's own for Gemma 3 only
        pattern = config.get("sliding_window_pattern") or pattern if architecture == "gemma3" else pattern
        kinds = [_layer_kind(layer, pattern) for layer in range(num_layers)]
    if kinds is None and architecture == "qwen2moe":
        below = config.get("max_window_layers", num_layers)
        kinds = ["sliding_attention" if layer % 2 == 0 and layer < below else "full_attention"
                 for layer in range(num_layers)]
    if kinds is None:
        kinds = ["sliding_attention"] * num_layers
    if len(kinds) != num_layers or not set(kinds) <= _LAYER_TYPES:
        raise ValueError(f"layer_types must list {num_layers} of {', '.join(sorted(_LAYER_TYPES))}, got {kinds}")
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _layer_kind(layer: int, pattern: int) -> str:
    """Every pattern-th layer attends to all keys, the others slide."""
    return "full_attention" if (layer + 1) % pattern == 0 else "sliding_attention"


def _hf_architecture(config: Mapping[str, Any]) -> str:
    found = (config.get("architectures") or [None])[0]
    if found not in HF_ARCHITECTURES:
        # A model whose code ships beside it (auto_map) is refused, never imported.
        remote_code = (
            " (its auto_map names custom code, which pagedllm never runs)" if config.get("auto_map") else ""
        )
        raise ValueError(
            f"Unsupported model architecture {found!r}{remote_code}; supported: {', '.join(HF_ARCHITECTURES)}"
        )
    return HF_ARCHITECTURES[found]


def _as_ids(value: int | Iterable[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _ordered_union(*id_groups: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(token_id for group in id_groups for token_id in group))
