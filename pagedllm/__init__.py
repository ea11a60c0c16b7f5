"""pagedllm: a PagedAttention inference engine with vLLM's interfaces.

The public names load lazily so that the pure-Python bookkeeping (pagedllm.kv,
pagedllm.engine.scheduler) can be imported without torch.
"""
import importlib

_PUBLIC = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.structured_output.params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "BeamSearchParams": "pagedllm.engine.beam_search",
    "BeamSearchOutput": "pagedllm.engine.beam_search",
    "CachePin": "pagedllm.engine.request",
    "PoolingParams": "pagedllm.pooling_params",
    "PoolerConfig": "pagedllm.pooling_params",
    "PoolingRequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
}
__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
