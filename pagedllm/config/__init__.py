"""The engine's configuration: every knob with vLLM's names (`engine.py`), speculative decoding's and LoRA's."""
from pagedllm.config.engine import (ACTIVATION_DTYPES, ATTENTION_BACKENDS, DATA_PARALLEL_ROUTINGS,
                                    DISTRIBUTED_EXECUTOR_BACKENDS, DTYPES, KV_CACHE_DTYPES, POOLING_CHOICES,
                                    PREEMPTION_MODES, QUANTIZATIONS, RUNNERS, SCHEDULING_POLICIES, EngineConfig,
                                    parse_memory_size)
from pagedllm.config.lora import LORA_DTYPES, MAX_LORA_RANKS, LoRAConfig
from pagedllm.config.speculative import SpeculativeConfig

__all__ = ["ACTIVATION_DTYPES", "ATTENTION_BACKENDS", "DATA_PARALLEL_ROUTINGS", "DISTRIBUTED_EXECUTOR_BACKENDS",
           "DTYPES", "KV_CACHE_DTYPES", "LORA_DTYPES", "MAX_LORA_RANKS", "POOLING_CHOICES", "PREEMPTION_MODES",
           "QUANTIZATIONS", "RUNNERS", "SCHEDULING_POLICIES", "EngineConfig", "LoRAConfig", "SpeculativeConfig",
           "parse_memory_size"]
