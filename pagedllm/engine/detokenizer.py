"""Token ids to text one step at a time, with stop strings, the way vLLM streams it."""
from __future__ import annotations

from pagedllm.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output, so the first output token gets the
# leading space (or lack of one) it would have in the full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns new token ids into new text, right for multi-byte UTF-8 split across tokens, and finds stop strings that span tokens.

    vLLM's prefix/read offsets: the text of tokens[prefix_offset:] minus that of
    tokens[prefix_offset:read_offset] is what the tokens after read_offset add.
    Decoding only this short window keeps each step O(1), and decoding it with its
    left context lets the tokenizer place spaces and merge bytes as a full decode would.
    spaces_between_special_tokens changes nothing here, as in vLLM: it only affects slow
    (Python) tokenizers, and a fast tokenizer's decoder joins special tokens without spaces.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if params.skip_special_tokens else frozenset()
        self._tokens = self._to_tokens(prompt_token_ids[-(_CONTEXT_TOKENS + 2):])
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_output_tokens = 0
        # A stop string that will be cut from the text must never be streamed, even in part.
        self._hold_back = max(map(len, self._stop)) - 1 if self._stop and not self._include_stop else 0
        self._streamed = 0
        self.output_text = ""

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        # Ids the tokenizer does not know (the model's vocab may be padded) decode to nothing.
        kept = [i for i in token_ids if i not in self._skipped_ids]
        return [token or "" for token in self._tokenizer.convert_ids_to_tokens(kept)]

    def _decode_next(self, token_id: int) -> str:
        self._tokens += self._to_tokens([token_id])
        convert = self._tokenizer.convert_tokens_to_string
        prefix_text = convert(self._tokens[self._prefix_offset:self._read_offset])
        new_text = convert(self._tokens[self._prefix_offset:])
        # A trailing U+FFFD is an incomplete UTF-8 sequence: wait for the token that completes it.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return new_text[len(prefix_text):]

    def append(self, new_token_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string that ended the text (which is then truncated), else None."""
        search_from = len(self.output_text)
        for token_id in new_token_ids:
            self.output_text += self._decode_next(token_id)
            self._num_output_tokens += 1
            # As vLLM: stop strings count only in text after the first min_tokens tokens.
            if self._num_output_tokens <= self._min_tokens:
                search_from = len(self.output_text)
        if self._num_output_tokens <= self._min_tokens:
            return None
        return self._find_stop(search_from)

    def _find_stop(self, new_text_start: int) -> str | None:
        """Earliest stop string that ends in the new text; truncates the text at it."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # Only a match reaching into the new text can be new.
            index = self.output_text.find(stop, max(new_text_start - len(stop) + 1, 0))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[:index + len(stop) if self._include_stop else index]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text so far, less a tail that could still become a stop string unless finished."""
        return self.output_text[:self._visible_end(finished)]

    def stream_delta(self, finished: bool) -> str:
        """Visible text not returned by an earlier call."""
        end = self._visible_end(finished)
        if end <= self._streamed:
            return ""
        delta = self.output_text[self._streamed:end]
        self._streamed = end
        return delta

    def _visible_end(self, finished: bool) -> int:
        return len(self.output_text) if finished else max(len(self.output_text) - self._hold_back, 0)
