"""The engine's per-token logprobs ({token_id: Logprob}) in OpenAI's two response shapes."""
from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from pagedllm.outputs import Logprob


def _top(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    """The num_top most likely tokens, best first (the sampled token is in the entry even when it ranks lower)."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= num_top),
                  key=lambda lp: lp.rank)


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
    """Chat's shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    def top_logprob(lp: Logprob) -> TopLogprob:
        return TopLogprob(token=lp.decoded_token, logprob=lp.logprob, bytes=list(lp.decoded_token.encode()))

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = top_logprob(entry[token_id])
        content.append(ChatTokenLogprob(**sampled.model_dump(),
                                        top_logprobs=[top_logprob(lp) for lp in _top(entry, num_top)]))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offset: int) -> CompletionLogprobs:
    """The legacy completions shape; text_offset is where the first token's text starts in the
    choice's text. top_logprobs holds the sampled token and the top-k, as vLLM's does."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry[token_id]
        result.tokens.append(sampled.decoded_token)
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({lp.decoded_token: lp.logprob for lp in entry.values()})
        result.text_offset.append(text_offset)
        text_offset += len(sampled.decoded_token)
    return result
