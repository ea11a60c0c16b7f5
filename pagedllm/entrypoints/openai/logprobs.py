"""The engine's per-token logprobs ({token_id: Logprob}) in OpenAI's two response shapes."""
from __future__ import annotations

from pagedllm.entrypoints.openai.response_protocol import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs,
                                                           PromptLogprob, TopLogprob)
from pagedllm.outputs import Logprob


def _top(entry: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The num_top most likely tokens, best first (the sampled token is in the entry even when it ranks lower)."""
    return sorted(((token_id, lp) for token_id, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
                  key=lambda item: item[1].rank)


def token_name(token_id: int, lp: Logprob, as_token_ids: bool) -> str:
    """The token as the response names it: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids),
    which stays unambiguous where several tokens decode to the same text or to partial characters."""
    return f"token_id:{token_id}" if as_token_ids else lp.decoded_token


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                  as_token_ids: bool = False) -> ChatLogprobs:
    """Chat's shape: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}."""
    def top_logprob(token_id: int, lp: Logprob) -> TopLogprob:
        token = token_name(token_id, lp, as_token_ids)
        return TopLogprob(token=token, logprob=lp.logprob, bytes=list(token.encode()))

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = top_logprob(token_id, entry[token_id])
        content.append(ChatTokenLogprob(**sampled.model_dump(),
                                        top_logprobs=[top_logprob(*item) for item in _top(entry, num_top)]))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]],
                        text_offset: int, as_token_ids: bool = False) -> CompletionLogprobs:
    """The legacy completions shape; text_offset is where the first token's text starts in the
    choice's text (offsets always count the text). top_logprobs holds the sampled token and the top-k,
    as vLLM's does."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry[token_id]
        result.tokens.append(token_name(token_id, sampled, as_token_ids))
        result.token_logprobs.append(sampled.logprob)
        result.top_logprobs.append({token_name(other, lp, as_token_ids): lp.logprob for other, lp in entry.items()})
        result.text_offset.append(text_offset)
        text_offset += len(sampled.decoded_token)
    result._end_offset = text_offset
    return result


def echoed_completion_logprobs(prompt_ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None],
                               first_token_text: str, token_ids: list[int],
                               logprobs: list[dict[int, Logprob]], as_token_ids: bool = False) -> CompletionLogprobs:
    """The legacy shape with echo: the prompt's tokens (the first with null logprobs: nothing scores
    it), then the generated ones, offsets counted from the start of the prompt."""
    echoed = completion_logprobs(prompt_ids[1:], prompt_logprobs[1:], len(first_token_text), as_token_ids)
    generated = completion_logprobs(token_ids, logprobs, echoed.end_offset, as_token_ids)
    first = f"token_id:{prompt_ids[0]}" if as_token_ids else first_token_text
    result = CompletionLogprobs(text_offset=[0, *echoed.text_offset, *generated.text_offset],
                                token_logprobs=[None, *echoed.token_logprobs, *generated.token_logprobs],
                                tokens=[first, *echoed.tokens, *generated.tokens],
                                top_logprobs=[None, *echoed.top_logprobs, *generated.top_logprobs])
    result._end_offset = generated.end_offset
    return result


def prompt_logprobs_field(prompt_logprobs: list[dict[int, Logprob] | None] | None
                          ) -> list[dict[int, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs extra: None first, then {token id: {logprob, rank, decoded_token}}."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {token_id: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for token_id, lp in entry.items()} for entry in prompt_logprobs]
