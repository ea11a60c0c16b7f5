"""Which runner a checkpoint gets (generate or pooling), and for pooling: its config, weights, pooler and
head, read from config.json and the sentence-transformers files beside it (modules.json,
1_Pooling/config.json, the Normalize module, config_sentence_transformers.json)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import safetensors
import torch

from pagedllm.model.bert import EncoderConfig, EncoderPoolingModel, encoder_unused, encoder_weight_shapes
from pagedllm.model.config import HF_ARCHITECTURES, ModelConfig, model_config_from_hf
from pagedllm.model.decoder_pooling import DecoderPoolingModel
from pagedllm.model.pooler import Pooler
from pagedllm.pooling_params import PoolerConfig
from pagedllm.model.weights import CheckpointWeights, expected_weight_shapes, load_safetensors_weights

logger = logging.getLogger(__name__)
# Encoder architectures by their weights' prefix under a classification head.
ENCODER_FAMILIES = {"Bert": "bert", "Roberta": "roberta", "XLMRoberta": "roberta"}
_POOLING_SUFFIXES = ("Model", "ForSequenceClassification")
# sentence-transformers' Pooling modes we run, and the flags that named them before version 6.
_ST_POOLING_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_POOLING_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_cls_token": "cls"}
_ST_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity"}


@dataclass(frozen=True)
class PoolingModelInfo:
    """What the engine and its entrypoints need to know about a pooling model."""
    pooler: PoolerConfig             # both fields resolved
    num_labels: int                  # 0: an embedding model; else the classification head's outputs
    score_activation: str            # a one-label classifier's score: "sigmoid" (CrossEncoder's default) or "identity"
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None   # None: `dimensions` is refused; (): any size up to hidden_size
    encoder: EncoderConfig | None    # BERT family

    @property
    def is_cross_encoder(self) -> bool:
        return self.num_labels > 0

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless the model can give embeddings of `dimensions` values (Matryoshka models only)."""
        if dimensions is None:
            return
        if self.matryoshka_dimensions is None:
            raise ValueError("dimensions is not supported by this model: it is not a Matryoshka model (set "
                             "is_matryoshka or matryoshka_dimensions in its config, or through hf_overrides)")
        allowed = self.matryoshka_dimensions or range(1, self.hidden_size + 1)
        if dimensions not in allowed:
            shown = f"one of {list(allowed)}" if self.matryoshka_dimensions else f"in [1, {self.hidden_size}]"
            raise ValueError(f"dimensions must be {shown}, got {dimensions}")


def chooses_pooling(runner: str, folder: Path, hf_config: dict) -> bool:
    """runner auto: pooling for encoder, bare-model and sequence-classification architectures, and for any
    checkpoint saved by sentence-transformers (modules.json); generate otherwise."""
    architecture = (hf_config.get("architectures") or [""])[0]
    pooling_only = architecture.endswith(_POOLING_SUFFIXES) or _encoder_family(architecture) is not None
    if runner == "generate" and pooling_only:
        raise ValueError(f"runner 'generate' cannot run {architecture}: it has no language-model head; "
                         "use runner 'pooling' (embeddings, scores)")
    return runner == "pooling" or (runner == "auto" and (pooling_only or (folder / "modules.json").is_file()))


def load_pooling_checkpoint(folder: Path, hf_config: dict, generation_config: dict | None,
                            pooler_config: PoolerConfig) -> tuple[ModelConfig, CheckpointWeights, PoolingModelInfo]:
    architecture = (hf_config.get("architectures") or [""])[0]
    classifies = architecture.endswith("ForSequenceClassification")
    num_labels = len(hf_config.get("id2label") or {0: "", 1: ""}) if classifies else 0
    family = _encoder_family(architecture)
    encoder = EncoderConfig.from_hf(hf_config, family, classifies) if family else None
    default = PoolerConfig("CLS" if encoder else "LAST", normalize=not classifies)
    pooler = pooler_config.or_else(_sentence_transformers_pooler(folder)).or_else(default)
    if classifies and pooler.pooling_type != default.pooling_type:
        raise ValueError(f"{architecture} classifies the {default.pooling_type} token's state; pooling_type "
                         f"{pooler.pooling_type} cannot serve it")
    if encoder is not None:
        config = _encoder_model_config(hf_config, architecture)
        expected = encoder_weight_shapes(config.hidden_size, config.intermediate_size, config.num_hidden_layers,
                                         config.vocab_size, hf_config["max_position_embeddings"], encoder, num_labels)
        weights = load_safetensors_weights(folder, config, expected, encoder_unused)
    else:
        config = model_config_from_hf({**hf_config, "architectures": [_causal_architecture(architecture)]},
                                      generation_config)
        weights = _decoder_weights(folder, config, num_labels)
    info = PoolingModelInfo(pooler=pooler, num_labels=num_labels,
                            score_activation=_score_activation(folder, hf_config),
                            hidden_size=config.hidden_size, matryoshka_dimensions=_matryoshka(folder, hf_config),
                            encoder=encoder)
    return config, weights, info


def build_pooling_model(config: ModelConfig, info: PoolingModelInfo, weights, dtype: torch.dtype,
                        device: torch.device, max_positions: int) -> torch.nn.Module:
    pooler = Pooler(info.pooler.pooling_type)
    if info.encoder is not None:
        return EncoderPoolingModel(config, info.encoder, weights, dtype, device, pooler)
    return DecoderPoolingModel(config, weights, dtype, device, max_positions, pooler, info.num_labels)


def _encoder_family(architecture: str) -> str | None:
    base = next((architecture.removesuffix(s) for s in _POOLING_SUFFIXES if architecture.endswith(s)), None)
    return ENCODER_FAMILIES.get(base)


def _causal_architecture(architecture: str) -> str:
    """Qwen3Model / Qwen3ForSequenceClassification -> Qwen3ForCausalLM: the same stack, another head."""
    for suffix in _POOLING_SUFFIXES:
        causal = architecture.removesuffix(suffix) + "ForCausalLM"
        if architecture.endswith(suffix) and causal in HF_ARCHITECTURES:
            return causal
    return architecture   # a *ForCausalLM run for pooling, or one model_config_from_hf refuses by name


def _encoder_model_config(hf_config: dict, architecture: str) -> ModelConfig:
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    positions = hf_config["max_position_embeddings"]
    family = ENCODER_FAMILIES[architecture.removesuffix("ForSequenceClassification").removesuffix("Model")]
    if family == "roberta":   # the first pad_token_id + 1 position rows are never used
        positions -= hf_config.get("pad_token_id", 1) + 1
    return ModelConfig(
        architecture=architecture, vocab_size=hf_config["vocab_size"], hidden_size=hidden,
        intermediate_size=hf_config["intermediate_size"], num_hidden_layers=hf_config["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, rotary_dim=0,
        layer_windows=(None,) * hf_config["num_hidden_layers"],
        rms_norm_eps=float(hf_config.get("layer_norm_eps", 1e-12)), rope_theta=0.0, rope_scaling=None,
        max_position_embeddings=positions, tie_word_embeddings=False, attention_bias=True, qk_norm=False,
        torch_dtype=hf_config.get("dtype") or hf_config.get("torch_dtype"), bos_token_id=None, eos_token_ids=())


def _checkpoint_names(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    with safetensors.safe_open(folder / "model.safetensors", framework="pt") as handle:
        return set(handle.keys())


def _decoder_weights(folder: Path, config: ModelConfig, num_labels: int) -> CheckpointWeights:
    """The decoder stack's tensors under the names CausalLM reads ("model.…"), whether the checkpoint keeps
    them so or bare (a saved Qwen3Model); plus the score head. An LM head, if stored, is left unread."""
    bare = "embed_tokens.weight" in _checkpoint_names(folder)
    shapes = expected_weight_shapes(replace(config, tie_word_embeddings=True))
    if bare:
        shapes = {name.removeprefix("model."): shape for name, shape in shapes.items()}
    if num_labels:
        shapes["score.weight"] = (num_labels, config.hidden_size)
    stored = load_safetensors_weights(folder, config, shapes, lambda name: name == "lm_head.weight")
    if not bare:
        return stored
    renamed = {name if name == "score.weight" else f"model.{name}": kind for name, kind in stored.formats.items()}
    return CheckpointWeights(lambda name, shard: stored.read(name.removeprefix("model."), shard), renamed)


def _sentence_transformers_pooler(folder: Path) -> PoolerConfig:
    """The pooling and normalisation a sentence-transformers checkpoint declares (empty if it is none)."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    pooling_type, normalize = None, False
    for module in json.loads(modules_file.read_text()):
        kind = module.get("type", "").rsplit(".", 1)[-1]   # the class name, wherever the version keeps it
        if kind == "Pooling":
            pooling_type = _st_pooling_mode(folder / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        elif kind == "Transformer":
            _check_st_transformer(folder / module.get("path", "") / "sentence_bert_config.json")
        else:
            raise ValueError(f"modules.json names a {module.get('type')!r} module, which pagedllm does not run "
                             "(it runs Transformer, Pooling and Normalize)")
    return PoolerConfig(pooling_type, normalize)


def _st_pooling_mode(path: Path) -> str:
    """The mode of a Pooling module's config.json: sentence-transformers 6 names it ("pooling_mode": "mean"),
    earlier versions set one of the pooling_mode_* flags."""
    settings = json.loads(path.read_text())
    named = settings.get("pooling_mode")
    modes = ([named] if isinstance(named, str) else list(named)) if named is not None else [
        _ST_POOLING_FLAGS.get(key, key) for key, value in settings.items() if key.startswith("pooling_mode") and value]
    if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
        raise ValueError(f"{path}: pooling modes {modes} are not supported; one of {', '.join(_ST_POOLING_MODES)} is")
    if not settings.get("include_prompt", True):
        raise ValueError(f"{path}: include_prompt false (pooling that skips the prompt's tokens) is not supported")
    return _ST_POOLING_MODES[modes[0]]


def _check_st_transformer(path: Path) -> None:
    settings = json.loads(path.read_text()) if path.is_file() else {}
    if settings.get("do_lower_case"):
        raise ValueError(f"{path}: do_lower_case is not supported (pagedllm passes text to the tokenizer as it is)")
    if "message" in (settings.get("modality_config") or {}):
        logger.warning("%s: sentence-transformers 6 renders each text through the tokenizer's chat template "
                       "(modality 'message'); pagedllm embeds the text as given, as vLLM does", path)


def _matryoshka(folder: Path, hf_config: dict) -> tuple[int, ...] | None:
    """vLLM's keys, in config.json (or hf_overrides) or config_sentence_transformers.json."""
    st_file = folder / "config_sentence_transformers.json"
    for source in (hf_config, json.loads(st_file.read_text()) if st_file.is_file() else {}):
        if source.get("matryoshka_dimensions"):
            return tuple(source["matryoshka_dimensions"])
        if source.get("is_matryoshka"):
            return ()
    return None


def _score_activation(folder: Path, hf_config: dict) -> str:
    """What a cross-encoder's one logit becomes as a score: CrossEncoder's activation_fn as it saved it (in
    config_sentence_transformers.json from version 6, in config.json before, or under its pre-4 key), else its
    default (sigmoid)."""
    st_file = folder / "config_sentence_transformers.json"
    saved = (json.loads(st_file.read_text()) if st_file.is_file() else {}).get("activation_fn") \
        or (hf_config.get("sentence_transformers") or {}).get("activation_fn") \
        or hf_config.get("sbert_ce_default_activation_function")
    if saved is None:
        return "sigmoid"
    if saved not in _ST_ACTIVATIONS:
        raise ValueError(f"activation_fn {saved!r} is not supported; one of {', '.join(_ST_ACTIVATIONS)} is")
    return _ST_ACTIVATIONS[saved]
