"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the model's thinking apart from its answer."""
from pagedllm.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}

__all__ = ["REASONING_PARSERS", "Qwen3ReasoningParser"]
