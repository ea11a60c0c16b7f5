"""Every engine knob in one place, with vLLM's names and defaults that work on this machine."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from pagedllm.pooling_params import POOLING_TYPES, PoolerConfig
from pagedllm.config.lora import LoRAConfig
from pagedllm.config.speculative import SpeculativeConfig

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DTYPES = ("auto", "float32", "bfloat16", "float16")
# auto: a GGUF keeps its own quantization, float checkpoints stay float; none: everything dequantized;
# int8 / int4: float weights quantized group-wise at load (pagedllm/model/quantization.py).
QUANTIZATIONS = ("auto", "none", "int8", "int4")
# What quantized layers multiply (as pagedllm/model/quantized_matmul.py's): auto, the model dtype's activations, or
# int16 where the CPU multiplies int16 faster (AVX2 without AVX-512, AVX-512 VNNI without BF16); model, the model
# dtype's at every row count; int16, activations quantized per row and 32-column group to int16 at every row count
# (as accurate); int8, to int8 (faster for small batches, less accurate).
ACTIVATION_DTYPES = ("auto", "model", "int16", "int8")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap", "auto")   # vLLM's old names, and auto (engine/preemption.py)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e5m2", "int8")   # auto: config/resolve.py
# vLLM's: mp runs one engine in this process (its tensor parallel workers as subprocesses);
# ray runs data_parallel_size engine replicas as Ray actors (pagedllm/engine/data_parallel.py).
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")
# How requests are spread over data-parallel replicas (pagedllm/engine/dp_router.py): prefix, to the replica holding
# the longest cached prefix of the prompt within a load-imbalance bound; least-loaded, by requests in flight only.
DATA_PARALLEL_ROUTINGS = ("prefix", "least-loaded")
# auto: triton on CUDA, the C++ kernels on CPU (pagedllm/model/attention/selector.py); torch: the PyTorch reference.
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "torch")
# vLLM's --runner: auto picks pooling for encoder, bare-model and sequence-classification checkpoints and for
# sentence-transformers folders (pagedllm/model/pooling_checkpoint.py), generate for the rest.
RUNNERS = ("auto", "generate", "pooling")
POOLING_CHOICES = tuple(kind.lower() for kind in POOLING_TYPES)   # --pooling, the short form of pooler_config


def parse_memory_size(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Bytes from an int or a string such as "4GiB", "512MB" or "1e9"; name: the field, for errors."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a byte count or a size such as '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise ValueError(f"{name} must be a byte count or a size such as '4GiB', got {value!r}")
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return size


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    activation_dtype: str = "auto"
    # Results of a request bitwise independent of its batch (quantized layers: one kernel for every row count).
    # Off by default: the row kernel alone is slower for prefill (docs/quantized_matmul.md).
    batch_invariant: bool = False
    kv_cache_dtype: str = "auto"
    device: str | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    enable_prefix_caching: bool = True
    # Most of the KV pool that cache pins (Anthropic's cache_control) may hold; a pin past it is shortened.
    max_pinned_kv_cache_fraction: float = 0.25
    # A disk tier under the prefix cache (docs/kv-cache.md, "KV tiers"): cached blocks evicted from RAM are kept
    # as files here, up to kv_cache_disk_bytes, and read back on a hit, across restarts too. None: off.
    kv_cache_dir: str | None = None
    kv_cache_disk_bytes: int | str = "8GiB"
    # How a preempted request gives back its KV blocks (docs/kv-cache.md, "Preemption"): recompute them later,
    # swap them out (to kv_cache_dir's quota if set, else to swap_space GiB of RAM) and back, or auto: the
    # cheaper of the two by measured cost.
    preemption_mode: str = "auto"
    swap_space: float = 4   # GiB of host RAM for swapped blocks when kv_cache_dir is not set (vLLM's old flag)
    enable_chunked_prefill: bool = True
    # Sequences sharing leading KV blocks read them once per step (CPU kernels; model/cascade.py). None ("auto"):
    # for the groups where the kernels, timed at start-up on this CPU, say it pays; True: every group; False: never
    # (docs/kv-cache.md, "Shared-prefix (cascade) attention").
    enable_cascade_attention: bool | None = None
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1   # ranks splitting each layer; the KV cache memory is per rank
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None   # None: ray when data_parallel_size > 1, else mp
    data_parallel_routing: str | None = None   # None: prefix with several replicas and prefix caching, else least-loaded
    # A replica gets a request for its cached prefix only while its requests in flight exceed the least loaded
    # replica's by at most this many (SGLang's router calls it balance_abs_threshold).
    data_parallel_balance_abs_threshold: int = 8
    attention_backend: str = "auto"   # auto: PAGEDLLM_ATTENTION_BACKEND if set, else the device's default
    speculative_config: SpeculativeConfig | dict | None = None   # a dict in vLLM's shape becomes a SpeculativeConfig
    runner: str = "auto"
    pooler_config: PoolerConfig | dict | None = None   # vLLM's; a dict becomes a PoolerConfig
    pooling: str | None = None        # last, mean or cls: pooler_config's pooling_type, in short
    hf_overrides: dict | None = None  # config.json keys replaced before it is read (vLLM's)
    # Multi-LoRA (pagedllm/lora/): requests name an adapter; off, a request with one is refused.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation_dtype must be one of {', '.join(ACTIVATION_DTYPES)}, "
                             f"got {self.activation_dtype!r}")
        if self.activation_dtype in ("int16", "int8") and self.quantization == "none":
            raise ValueError(f"activation_dtype {self.activation_dtype!r} multiplies quantized weights, and quantization "
                             "'none' leaves none: use quantization auto (a quantized GGUF), int8 or int4")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if not (isinstance(self.block_size, int) and 8 <= self.block_size <= 256
                and self.block_size & (self.block_size - 1) == 0):
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {self.block_size!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_num_batched_tokens is not None and (
                not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1):
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be an integer >= 1, got {self.max_model_len!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not (isinstance(self.max_pinned_kv_cache_fraction, (int, float))
                and not isinstance(self.max_pinned_kv_cache_fraction, bool)
                and 0 <= self.max_pinned_kv_cache_fraction <= 1):
            raise ValueError(f"max_pinned_kv_cache_fraction must be in [0, 1], got {self.max_pinned_kv_cache_fraction!r}")
        self._check_cascade_attention()
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "batch_invariant", "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if not (isinstance(self.tensor_parallel_size, int) and not isinstance(self.tensor_parallel_size, bool)
                and self.tensor_parallel_size >= 1):
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        self._check_kv_disk_tier()
        self._check_preemption()
        self._check_data_parallel()
        self._check_pooling()
        self.lora_config   # checks the LoRA limits even while enable_lora is off
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
            if self.speculative_config.method == "draft_model" and self.enable_lora:
                raise ValueError("speculative_config method 'draft_model' does not run with enable_lora (the draft "
                                 "model has no adapters); use method 'ngram', which does")
            if self.speculative_config.method == "draft_model" and self.tensor_parallel_size > 1:
                raise ValueError("speculative_config method 'draft_model' runs with tensor_parallel_size 1 only, "
                                 f"got tensor_parallel_size {self.tensor_parallel_size}")

    def _check_cascade_attention(self) -> None:
        if self.enable_cascade_attention == "auto":
            self.enable_cascade_attention = None
        if self.enable_cascade_attention is not None and not isinstance(self.enable_cascade_attention, bool):
            raise ValueError(f"enable_cascade_attention must be True, False or None ('auto'), "
                             f"got {self.enable_cascade_attention!r}")
        if self.enable_cascade_attention and self.batch_invariant is True:
            raise ValueError("enable_cascade_attention=True does not run with batch_invariant=True: a row's attention "
                             "would depend on the group it shares; leave it None (auto: off there) or False")

    def _check_preemption(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if self.preemption_mode == "swap" and self.kv_cache_dir is None and self.swap_space == 0:
            raise ValueError("preemption_mode 'swap' needs a place for swapped blocks: swap_space > 0 (GiB of RAM) "
                             "or kv_cache_dir")

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * 2**30)

    def _check_kv_disk_tier(self) -> None:
        self.kv_cache_disk_bytes = parse_memory_size(self.kv_cache_disk_bytes, "kv_cache_disk_bytes")
        if self.kv_cache_dir is None:
            return
        if not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir:
            raise ValueError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir keeps prefix-cache blocks on disk: it needs enable_prefix_caching=True")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dir runs with tensor_parallel_size 1 only, got {self.tensor_parallel_size}")
        spec = self.speculative_config
        method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
        if method == "draft_model":
            raise ValueError("kv_cache_dir does not keep a draft model's KV: use it without draft_model speculation")

    def _check_pooling(self) -> None:
        """Resolves pooler_config (from itself and the short `pooling`) and checks the runner knobs."""
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a mapping of config.json keys, got {self.hf_overrides!r}")
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.from_value(self.pooler_config)
        if self.pooling is None:
            return
        if self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_CHOICES)}, got {self.pooling!r}")
        given = self.pooler_config or PoolerConfig()
        if given.pooling_type not in (None, self.pooling.upper()):
            raise ValueError(f"pooling {self.pooling!r} contradicts pooler_config's pooling_type {given.pooling_type!r}")
        self.pooler_config = PoolerConfig(self.pooling.upper(), given.normalize)

    def _check_data_parallel(self) -> None:
        """Resolves distributed_executor_backend and refuses combinations that cannot run."""
        size = self.data_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"data_parallel_size must be an integer >= 1, got {size!r}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "ray" if size > 1 else "mp"
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}, got {self.distributed_executor_backend!r}")
        if size > 1 and self.distributed_executor_backend != "ray":
            raise ValueError(f"data_parallel_size > 1 needs distributed_executor_backend 'ray' (mp runs a single "
                             f"engine), got data_parallel_size {size} with "
                             f"{self.distributed_executor_backend!r}")
        if self.data_parallel_routing is None:
            self.data_parallel_routing = "prefix" if size > 1 and self.enable_prefix_caching else "least-loaded"
        if self.data_parallel_routing not in DATA_PARALLEL_ROUTINGS:
            raise ValueError(f"data_parallel_routing must be one of {', '.join(DATA_PARALLEL_ROUTINGS)}, "
                             f"got {self.data_parallel_routing!r}")
        if self.data_parallel_routing == "prefix" and not self.enable_prefix_caching:
            raise ValueError("data_parallel_routing 'prefix' routes by the replicas' prefix caches: it needs "
                             "enable_prefix_caching=True (or use 'least-loaded')")
        threshold = self.data_parallel_balance_abs_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"data_parallel_balance_abs_threshold must be an integer >= 0, got {threshold!r}")

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits when enable_lora is on, else None."""
        limits = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)
        return limits if self.enable_lora else None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
