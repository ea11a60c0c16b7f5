"""The shadow KV cache: what the runner's writes and block copies would leave in the KV cache, one token id per
slot, so that a sequence read back through its block table shows any block given to the wrong sequence."""
from __future__ import annotations

from array import array


class ShadowKV:
    """One token id per KV slot, and per block the cache salt of its last writer: the runner's writes
    and block copies without tensors. A sequence read back through its block table must give its own
    tokens, from blocks all written under its own salt.

    Beams are read back every step, so each read-back remembers, per sequence, the whole blocks it found
    right and their write versions (a block's version goes up with every write or copy into it). The next
    read-back of that sequence compares only from the first block whose id or version differs: a block
    nobody wrote since it read right still reads right (a sequence's computed tokens never change), so
    every read-back gives the answer a full one would, at a fraction of the cost."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.salts: list[str | None] = [None] * num_blocks
        self.versions = array("q", bytes(8 * num_blocks))   # not ints in a list: those past 256 are heap objects
        # sequence id -> (block ids of its leading whole blocks that read back right, their versions then)
        self.verified: dict[str, tuple[list[int], list[int]]] = {}

    def clear(self) -> None:
        """Forgets every slot and every read-back: once the whole pool is evicted no block's content may be read
        again (and slots holding old token ids would keep those ints alive)."""
        self.slots[:] = [None] * len(self.slots)
        self.salts[:] = [None] * len(self.salts)
        self.verified.clear()

    def forget(self) -> None:
        """Drops what earlier read-backs found right: called when no sequence is left (an idle point)."""
        self.verified.clear()

    def copy(self, copies: list[tuple[int, int]]) -> None:
        size, slots = self.block_size, self.slots
        for source, target in copies:
            slots[target * size:(target + 1) * size] = slots[source * size:(source + 1) * size]
            self.salts[target] = self.salts[source]
            self.versions[target] += 1

    def write_decodes(self, slots: list[int], block_ids: list[int], tokens: list[int],
                      salts: list[str | None]) -> None:
        """One token each: tokens[i] into slot slots[i] of block block_ids[i], written under salts[i]."""
        versions = self.versions
        for slot, block, token, salt in zip(slots, block_ids, tokens, salts):
            self.slots[slot] = token
            self.salts[block] = salt
            versions[block] += 1

    def write(self, block_ids: list[int], first_block: int, tokens: list[int], start: int, salt: str | None) -> None:
        """tokens into the slots from position start on; block_ids are the table's entries from first_block on."""
        size, slots, salts, versions = self.block_size, self.slots, self.salts, self.versions
        position, end, taken = start, start + len(tokens), 0
        while position < end:
            offset = position % size
            take = min(size - offset, end - position)
            block = block_ids[position // size - first_block]
            slots[block * size + offset:block * size + offset + take] = tokens[taken:taken + take]
            salts[block] = salt
            versions[block] += 1
            position += take
            taken += take

    def reads_back(self, sequence_id: str, block_ids: list[int], tokens: list[int], count: int,
                   salt: str | None) -> bool:
        """Whether the first `count` tokens read through the table are the sequence's own."""
        size, slots, salts, versions = self.block_size, self.slots, self.salts, self.versions
        first = 0
        known = self.verified.get(sequence_id)
        if known is not None:
            known_blocks, known_versions = known
            first = len(known_blocks)
            if first * size > count or block_ids[:first] != known_blocks or [
                    versions[block] for block in known_blocks] != known_versions:
                first = 0
        for index in range(first * size, count, size):
            take = min(size, count - index)
            block = block_ids[index // size]
            if slots[block * size:block * size + take] != tokens[index:index + take] or salts[block] != salt:
                self.verified.pop(sequence_id, None)
                return False
        whole = block_ids[:count // size]
        if first:
            known_versions.extend(versions[block] for block in whole[first:])
            self.verified[sequence_id] = (whole, known_versions)
        else:
            self.verified[sequence_id] = (whole, [versions[block] for block in whole])
        return True
