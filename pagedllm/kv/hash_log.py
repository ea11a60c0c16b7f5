"""Which block hashes a replica's tiers gain and lose, recorded for a data-parallel router to mirror elsewhere.

The KV manager's tiers record here on the engine thread as a full block enters or leaves the RAM prefix cache
or the disk tier; the replica drains the record on another thread (its event loop) with no lock, since a
deque's append and popleft are atomic. A hash is kept as its first 8 bytes: the router only picks a replica
with it, so a collision can misroute a request, never share KV. Past max_events undrained (nobody asked for a
while) the log stops recording and reports that it overflowed; the next report is then a whole snapshot
(taken on the engine thread, which restarts the log in the same step), so memory stays bounded.
"""
from __future__ import annotations

from collections import deque

RAM, DISK = 1, 2   # tier bits: a router keeps, per hash, the bits of the tiers that hold it

BlockHashEvent = tuple[int, int, bool]   # (short hash, tier bit, held after the event)


def short_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


class BlockHashLog:
    def __init__(self, max_events: int):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.max_events = max_events
        self._events: deque[BlockHashEvent] = deque()
        self.overflowed = True   # a new log has no history to send: the first report is a snapshot

    def record(self, block_hash: bytes, tier: int, held: bool) -> None:
        """On the engine thread: `block_hash` entered (held) or left the tier."""
        if self.overflowed:
            return
        if len(self._events) >= self.max_events:
            self.overflowed = True
            return
        self._events.append((short_hash(block_hash), tier, held))

    def drain(self) -> list[BlockHashEvent] | None:
        """The events since the last drain, oldest first; None when the log overflowed (a snapshot is due).
        One drainer at a time."""
        events = [self._events.popleft() for _ in range(len(self._events))]
        return None if self.overflowed else events

    def restart(self) -> None:
        """On the engine thread, with the snapshot that replaces the lost events."""
        self._events.clear()
        self.overflowed = False
