"""vLLM's bad_words as token-id sequences: each word as it would appear at the start of a text and after a space."""
from __future__ import annotations

from pagedllm.tokenizer import Tokenizer


def bad_words_token_ids(tokenizer: Tokenizer, bad_words: list[str]) -> list[list[int]]:
    """For each word, its tokens without and with a leading space; as in vLLM, the spaced form is added
    only when the space merges into the word's first token (as many tokens, another first token)."""
    sequences = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not plain:   # a word without tokens bans nothing (byte-level tokenizers always give some)
            continue
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
