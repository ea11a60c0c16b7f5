"""Reads a PEFT LoRA folder and checks it against the base model, so a bad adapter is refused at load, with the reason.

Supported: LoRA (no DoRA, no biases) on the decoder layers' q/k/v/o and gate/up/down projections of a dense layer,
any rank up to max_lora_rank, `lora_alpha / r` scaling or rsLoRA's `lora_alpha / sqrt(r)`, with PEFT's per-module
rank_pattern / alpha_pattern. The scaling is folded into B once here, so the hot path multiplies twice and adds.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from pagedllm.config.lora import LoRAConfig
from pagedllm.lora.request import LoRARequest
from pagedllm.model.config import ModelConfig
from pagedllm.model.moe_config import is_sparse

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
# PEFT options that change what the adapter computes beyond x @ A.T @ B.T * scaling.
UNSUPPORTED_OPTIONS = ("alora_invocation_tokens", "layer_replication", "target_parameters", "trainable_token_indices",
                       "use_qalora", "use_bdlora")
_WEIGHT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class ModuleLoRA:
    """One projection's low-rank update, delta = x @ lora_a.T @ lora_b.T, the scaling already inside lora_b."""
    lora_a: torch.Tensor   # [rank, in_features]
    lora_b: torch.Tensor   # [out_features, rank]

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A checked adapter: (layer index, HF module name such as "q_proj") -> its update, float32 on the CPU."""
    lora_request: LoRARequest
    modules: dict[tuple[int, str], ModuleLoRA]

    @property
    def rank(self) -> int:
        return max(module.rank for module in self.modules.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each supported projection in the unsharded base model."""
    hidden, q_size = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_size, intermediate = config.num_key_value_heads * config.head_dim, config.intermediate_size
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden)}


def load_peft_adapter(lora_request: LoRARequest, model_config: ModelConfig, lora_config: LoRAConfig) -> LoRAAdapter:
    """The adapter at lora_request.lora_path, checked against this base; ValueError naming what is wrong."""
    name, path = lora_request.lora_name, lora_request.lora_path
    if not path or not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: lora_path {path!r} is not a directory (a PEFT adapter folder with "
                         f"{CONFIG_FILE} and {WEIGHT_FILES[0]})")
    peft_config = _read_config(name, path)
    weights = _read_weights(name, path)
    pairs = _pair_weights(name, weights)
    shapes = module_shapes(model_config)
    modules = {}
    for (layer, kind, module), (lora_a, lora_b) in sorted(pairs.items()):
        where = f"model.layers.{layer}.{kind}.{module}"
        _check_module(name, where, layer, module, model_config)
        in_features, out_features = shapes[module]
        rank = lora_a.shape[0]
        if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[1] != in_features or lora_b.shape != (
                out_features, rank):
            raise ValueError(f"LoRA adapter {name!r} does not fit this base model: {where} lora_A is "
                             f"{list(lora_a.shape)} and lora_B {list(lora_b.shape)}, the base needs "
                             f"[r, {in_features}] and [{out_features}, r]")
        if rank > lora_config.max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank} at {where}, over max_lora_rank "
                             f"{lora_config.max_lora_rank}; start the engine with a larger max_lora_rank")
        scaling = _scaling(peft_config, where, rank)
        modules[(layer, module)] = ModuleLoRA(lora_a.float().contiguous(), (lora_b.float() * scaling).contiguous())
    if not modules:
        raise ValueError(f"LoRA adapter {name!r} holds no lora_A / lora_B weights")
    return LoRAAdapter(lora_request, modules)


def _read_config(name: str, path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is missing (a PEFT adapter folder has one)")
    try:
        with open(config_path) as file:
            config = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is not readable JSON: {exc}") from None
    checks = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type must be LORA, got {config.get('peft_type')!r}"),
        (bool(config.get("use_dora")), "use_dora (DoRA) is not supported"),
        (config.get("bias", "none") != "none", f"bias must be 'none', got {config.get('bias')!r}"),
        (bool(config.get("lora_bias")), "lora_bias is not supported"),
        (bool(config.get("modules_to_save")),
         f"modules_to_save ({config.get('modules_to_save')}) replaces whole base modules, which is not supported"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (Conv1D bases) is not supported"),
        (not isinstance(config.get("r"), int) or config["r"] < 1, f"r must be a positive integer, got {config.get('r')!r}"),
    ]
    for failed, reason in checks:
        if failed:
            raise ValueError(f"LoRA adapter {name!r}: {reason}")
    for key in UNSUPPORTED_OPTIONS:
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {key} ({config[key]!r}) is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):   # names, or (from "all-linear") dotted paths ending in one
        unsupported = sorted({target for target in targets if target.rsplit(".", 1)[-1] not in SUPPORTED_MODULES})
        if unsupported:
            raise ValueError(f"LoRA adapter {name!r} targets unsupported module(s) {', '.join(unsupported)}; "
                             f"supported: {', '.join(SUPPORTED_MODULES)} (or 'all-linear')")
    return config


def _read_weights(name: str, path: str) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = (os.path.join(path, file) for file in WEIGHT_FILES)
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file
        return load_file(safetensors_path)
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {name!r}: neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]} is in {path}")


def _pair_weights(name: str, weights: dict[str, torch.Tensor]
                  ) -> dict[tuple[int, str, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, self_attn or mlp, module) -> (lora_A, lora_B); any other tensor is refused, naming it."""
    halves: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _WEIGHT_KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r} has weight {key!r}, which is not supported: only lora_A / "
                             f"lora_B of the decoder layers' {', '.join(SUPPORTED_MODULES)} load (no embeddings, "
                             "lm_head, DoRA magnitudes or biases)")
        layer, kind, module, half = match.groups()
        halves.setdefault((int(layer), kind, module), {})[half] = tensor
    pairs = {}
    for place, found in halves.items():
        if set(found) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: model.layers.{place[0]}.{place[1]}.{place[2]} has lora_"
                             f"{''.join(found)} without its other half")
        pairs[place] = (found["A"], found["B"])
    return pairs


def _check_module(name: str, where: str, layer: int, module: str, model_config: ModelConfig) -> None:
    kind = where.split(".")[3]
    if module not in SUPPORTED_MODULES or (kind == "self_attn") != (module in ATTENTION_MODULES):
        raise ValueError(f"LoRA adapter {name!r} targets {where}, which is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODULES)}")
    if layer >= model_config.num_hidden_layers:
        raise ValueError(f"LoRA adapter {name!r} does not fit this base model: {where}, but the base has "
                         f"{model_config.num_hidden_layers} layers")
    if module in MLP_MODULES and is_sparse(model_config.moe, layer):
        raise ValueError(f"LoRA adapter {name!r} targets {where}, a mixture-of-experts layer: LoRA on experts is "
                         "not supported")


def _pattern_value(patterns: dict, where: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key matching the module's name (as its own suffix)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", where):
            return value
    return default


def _scaling(config: dict, where: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), where, config.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
