"""The shadow KV cache: what the runner's writes and block copies would leave in the KV cache, one token id per
slot, so that a sequence read back through its block table shows any block given to the wrong sequence."""
from __future__ import annotations


class ShadowKV:
    """One token id per KV slot, and per block the cache salt of its last writer: the runner's writes
    and block copies without tensors. A sequence read back through its block table must give its own
    tokens, from blocks all written under its own salt."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.salts: list[str | None] = [None] * num_blocks

    def clear(self) -> None:
        """Forgets every slot: once the whole pool is evicted no block's content may be read again
        (and slots holding old token ids would keep those ints alive)."""
        self.slots[:] = [None] * len(self.slots)
        self.salts[:] = [None] * len(self.salts)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        size, slots = self.block_size, self.slots
        for source, target in copies:
            slots[target * size:(target + 1) * size] = slots[source * size:(source + 1) * size]
            self.salts[target] = self.salts[source]

    def write(self, block_ids: list[int], tokens: list[int], start: int, count: int, salt: str | None) -> None:
        size, slots, salts = self.block_size, self.slots, self.salts
        if count == 1:   # a decode step
            block = block_ids[start // size]
            slots[block * size + start % size] = tokens[start]
            salts[block] = salt
            return
        end = start + count
        while start < end:
            offset = start % size
            take = min(size - offset, end - start)
            block = block_ids[start // size]
            slots[block * size + offset:block * size + offset + take] = tokens[start:start + take]
            salts[block] = salt
            start += take

    def reads_back(self, block_ids: list[int], tokens: list[int], count: int, salt: str | None) -> bool:
        """Whether the first `count` tokens read through the table are the sequence's own."""
        size, slots, salts = self.block_size, self.slots, self.salts
        for index in range(0, count, size):
            take = min(size, count - index)
            block = block_ids[index // size]
            if slots[block * size:block * size + take] != tokens[index:index + take] or salts[block] != salt:
                return False
        return True

