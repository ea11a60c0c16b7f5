"""Read-ahead for the KV disk tier: block files of waiting requests read into memory by a thread of their own
while other requests' steps run, so that the step that loads them only copies them into the pool.

The scheduler names the blocks (a waiting request whose prefix continues on disk but whose blocks are not free
yet); the files are read and checked (DiskKVStore's own read: header, key digest, length, crc32) off the engine
thread. A load takes its payload from here when it is ready and reads the file itself otherwise, so a hint is
only ever an optimisation. At most `capacity` payloads are kept, the oldest dropped first.
"""
from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch


class ReadAhead:
    def __init__(self, read: Callable[[str, bytes], torch.Tensor | None], capacity: int):
        """read(file name, key digest): the checked payload, or None; capacity: payloads kept at most."""
        self._read = read
        self.capacity = capacity
        self._ready: OrderedDict[str, tuple[bytes, torch.Tensor]] = OrderedDict()
        self._asked: set[str] = set()   # queued or being read
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read_loop, name="kv-disk-read-ahead", daemon=True)
        self._reader.start()

    def ask(self, name: str, digest: bytes) -> None:
        """Reads the file in the background, unless it is ready or asked for already."""
        with self._lock:
            if self.capacity == 0 or name in self._ready or name in self._asked:
                return
            self._asked.add(name)
        self._queue.put((name, digest))

    def take(self, name: str, digest: bytes) -> torch.Tensor | None:
        """The payload read ahead for this file and key, given up; None when it is not ready (the caller reads)."""
        with self._lock:
            entry = self._ready.get(name)
            if entry is None or entry[0] != digest:
                return None
            del self._ready[name]
        return entry[1]

    def forget(self, name: str) -> None:
        """The file is deleted: a payload read ahead for it goes too."""
        with self._lock:
            self._ready.pop(name, None)

    def flush(self) -> None:
        """Returns once every file asked for is read."""
        self._queue.join()

    def close(self) -> None:
        """Stops the reader (after the files asked for so far)."""
        self._queue.put(None)
        self._reader.join()

    def _read_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            name, digest = item
            try:
                payload = self._read(name, digest)
                with self._lock:
                    self._asked.discard(name)
                    if payload is not None:
                        self._ready[name] = (digest, payload)
                        while len(self._ready) > self.capacity:
                            self._ready.popitem(last=False)
            finally:
                self._queue.task_done()
