"""The engine's per-token logprobs ({token_id: Logprob}) in OpenAI's two response shapes."""
from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                                  TopLogprob)
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


def echoed_completion_logprobs(prompt_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None],
                               first_token_text: str, token_ids: list[int],
                               logprobs: list[dict[int, Logprob]]) -> CompletionLogprobs:
    """The legacy shape with echo: the prompt's tokens (the first with null logprobs: nothing scores
    it), then the generated ones, offsets counted from the start of the prompt."""
    echoed = completion_logprobs(prompt_ids[1:], prompt_logprobs[1:], len(first_token_text))
    end = len(first_token_text) + sum(map(len, echoed.tokens))
    generated = completion_logprobs(token_ids, logprobs, end)
    return CompletionLogprobs(text_offset=[0, *echoed.text_offset, *generated.text_offset],
                              token_logprobs=[None, *echoed.token_logprobs, *generated.token_logprobs],
                              tokens=[first_token_text, *echoed.tokens, *generated.tokens],
                              top_logprobs=[None, *echoed.top_logprobs, *generated.top_logprobs])


def prompt_logprobs_field(prompt_logprobs: list[dict[int, Logprob] | None] | None
                          ) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs extra: None first, then {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {token_id: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in entry.items()} for entry in prompt_logprobs]
