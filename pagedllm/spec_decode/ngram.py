"""N-gram proposals (prompt lookup): find the request's last few tokens earlier in its own prompt and output,
and propose what followed them there. Costs no model pass; pays on copy-heavy text (summaries, edits,
quoted code), finds nothing on text that does not repeat itself."""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, num_tokens: int) -> list[int]:
    """Up to num_tokens ids that followed the first earlier occurrence of the sequence's last n tokens, for
    the longest n in [min_n, max_n] that occurs; [] when none does. The first occurrence (as transformers'
    prompt lookup) leaves the most tokens after it: in a loop, the latest one is the loop's last turn.

    Runs for every speculating request in every step, so it compares whole windows only where the last
    token occurs: those places are extended backwards one token at a time, while any still matches."""
    length = len(token_ids)
    if length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Where earlier windows could end (before the last token, so each leaves a token to propose after it).
    ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
    matched = 1   # every end in `ends` matches the last `matched` tokens
    while len(ends) and matched < max_n:
        longer = ends[ends >= matched]
        longer = longer[tokens[longer - matched] == tokens[length - 1 - matched]]
        if not len(longer):
            break
        ends, matched = longer, matched + 1
    if not len(ends) or matched < min_n:
        return []
    start = int(ends[0]) + 1
    return tokens[start:start + num_tokens].tolist()
