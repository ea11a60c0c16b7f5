"""N-gram proposals (prompt lookup): find the request's last few tokens earlier in its own prompt and output,
and propose what followed them there. Costs no model pass; pays on copy-heavy text (summaries, edits,
quoted code), finds nothing on text that does not repeat itself."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to num_tokens ids that followed the first earlier occurrence of the sequence's last n tokens, for
    the longest n in [min_n, max_n] that occurs; [] when none does. The first occurrence (as transformers'
    prompt lookup) leaves the most tokens after it: in a loop, the latest one is the loop's last turn."""
    length = len(token_ids)
    if length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that end before the last token: each leaves at least one token to propose after it.
        windows = sliding_window_view(tokens[:length - 1], n)
        matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(matches):
            start = int(matches[0]) + n
            return tokens[start:start + num_tokens].tolist()
    return []
