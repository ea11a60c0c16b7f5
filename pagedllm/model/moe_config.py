"""The mixture-of-experts facts of a model (Mixtral, Qwen2-MoE, Qwen3-MoE), read from config.json or GGUF keys."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

# HF architectures (ModelConfig.architecture) whose feed-forward layers may be sparse.
HF_MOE_ARCHITECTURES = ("mixtral", "qwen2moe", "qwen3moe")
# llama.cpp leaves the top-k weights as they are for Qwen2-MoE and renormalises them for Mixtral ("llama")
# and Qwen3-MoE, unless the file says otherwise (expert_weights_norm).
_GGUF_NORM_TOPK_PROB = {"llama": True, "qwen2moe": False, "qwen3moe": True}


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int            # each routed expert's
    # Renormalise the top-k routing probabilities to sum to one. Mixtral's softmax over its top-k
    # logits is exactly this: softmax over all, top k, renormalised.
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # Qwen2-MoE's always-on expert, gated by sigmoid; 0 for none
    sparse_layers: tuple[bool, ...]       # per layer: routed experts (True) or one dense MLP


def is_sparse(moe: MoeConfig | None, layer: int) -> bool:
    return moe is not None and moe.sparse_layers[layer]


def gated_mlp_prefixes(moe: MoeConfig | None, layer: int, mlp_prefix: str) -> list[str]:
    """The prefixes of a layer's gate/up/down MLPs: every expert's and the shared one's (sparse) or the
    layer's own (dense)."""
    if not is_sparse(moe, layer):
        return [mlp_prefix]
    shared = [mlp_prefix + "shared_expert."] if moe.shared_expert_intermediate_size else []
    return [f"{mlp_prefix}experts.{expert}." for expert in range(moe.num_experts)] + shared


def moe_config_from_hf(config: Mapping[str, Any], architecture: str) -> MoeConfig | None:
    """Mixtral routes every layer; Qwen2/3-MoE the layers that decoder_sparse_step selects and
    mlp_only_layers does not list, as transformers builds them."""
    if architecture not in HF_MOE_ARCHITECTURES:
        return None
    num_layers = config["num_hidden_layers"]
    num_experts = config.get("num_experts") or config.get("num_local_experts") or 0
    top_k = config["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be between 1 and the number of experts ({num_experts}), "
                         f"got {top_k}")
    if architecture == "mixtral":
        return MoeConfig(num_experts, top_k, config["intermediate_size"], True, 0, (True,) * num_layers)
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=config["moe_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0)
        if architecture == "qwen2moe" else 0,
        sparse_layers=tuple(layer not in dense and (layer + 1) % step == 0 for layer in range(num_layers)),
    )


def moe_config_from_gguf(architecture: str, optional: Callable[[str, Any], Any], tensor_names: Collection[str],
                         num_layers: int, feed_forward_length: int) -> MoeConfig | None:
    """llama.cpp's expert keys; a layer is sparse where its router (ffn_gate_inp) is stored, and it has a
    shared expert where ffn_gate_shexp is."""
    num_experts = optional("expert_count", 0)
    if not num_experts:
        if architecture in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF metadata lacks {architecture}.expert_count")
        return None
    if architecture not in _GGUF_NORM_TOPK_PROB:
        raise ValueError(f"GGUF architecture {architecture!r} with experts is not supported; experts load for "
                         f"{', '.join(_GGUF_NORM_TOPK_PROB)}")
    sparse = tuple(f"blk.{layer}.ffn_gate_inp.weight" in tensor_names for layer in range(num_layers))
    shared = 0
    if any(f"blk.{layer}.ffn_gate_shexp.weight" in tensor_names for layer in range(num_layers)):
        shared = optional("expert_shared_feed_forward_length", 0)
        if not shared:
            raise ValueError(f"GGUF has shared-expert tensors but its metadata lacks "
                             f"{architecture}.expert_shared_feed_forward_length")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=optional("expert_used_count", 0) or _missing(architecture, "expert_used_count"),
        moe_intermediate_size=optional("expert_feed_forward_length", 0) or feed_forward_length,
        norm_topk_prob=bool(optional("expert_weights_norm", _GGUF_NORM_TOPK_PROB[architecture])),
        shared_expert_intermediate_size=shared,
        sparse_layers=sparse,
    )


def _missing(architecture: str, key: str):
    raise ValueError(f"GGUF metadata lacks {architecture}.{key}")
