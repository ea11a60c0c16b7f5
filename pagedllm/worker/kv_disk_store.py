"""The disk tier's bytes: one file per KV block under --kv-cache-dir, written by a background thread.

A spilled block is copied out of the pool tensors at once (the block may be overwritten in the same
step) and written later, so a step never waits on the disk. A file is written under a temporary name
and renamed, and carries a header (magic, key digest, payload length, crc32), so a write cut short by
a crash or a damaged file is refused on read, never served. The directory (0700, files 0600) records the
identity of the model and cache layout it was made for, and a secret root for the block-hash chains, so
that hashes are stable across restarts yet unguessable from outside.

Swapped-out blocks of preempted requests (preemption_mode swap) go through the same writer under their own
suffix, checksummed the same way; they belong to requests of this process only, so a start-up removes any it
finds, as it does temporary files that a killed process left half written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import secrets
import struct
import threading
import zlib
from pathlib import Path

import torch

from pagedllm.model.attention.cache import CacheTensor
from pagedllm.worker.kv_read_ahead import ReadAhead

logger = logging.getLogger(__name__)

MAGIC = b"PLKVBLK1"
HEADER = struct.Struct("<8s32sQI")   # magic, key digest, payload bytes, crc32 of the payload
HEADER_BYTES = HEADER.size
IDENTITY_FILE = "identity.json"
ROOT_FILE = "root_hash"
BLOCK_SUFFIX = ".kv"
SWAP_SUFFIX = ".kvswap"
# Test hook (tests/kv/test_kv_sigkill.py): the path of a FIFO. The writer then stops in its first block write
# after half the file, says so through the FIFO and waits forever, for the test to SIGKILL the process there.
HOLD_MID_WRITE_ENV = "PAGEDLLM_TEST_KV_HOLD_MID_WRITE"
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".json")
FINGERPRINT_SPAN = 2**20   # bytes read from each end of a weight file


def weights_fingerprint(source: str) -> str:
    """sha256 over each checkpoint file's name, size and first and last MiB: cheap for large checkpoints,
    and different for any other set of weights in practice."""
    path = Path(source)
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES)
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(FINGERPRINT_SPAN))
            handle.seek(max(0, size - FINGERPRINT_SPAN))
            digest.update(handle.read(FINGERPRINT_SPAN))
    return digest.hexdigest()


def open_kv_cache_dir(directory: str, identity: dict) -> bytes:
    """Creates the directory (0700) or checks that it was made for this identity; returns its root hash.
    Refuses a directory made for another model or layout, naming what differs."""
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    identity_file = path / IDENTITY_FILE
    if identity_file.exists():
        recorded = json.loads(identity_file.read_text())
        differs = [f"{key} {recorded.get(key)!r} there, {value!r} here" for key, value in identity.items()
                   if recorded.get(key) != value]
        if differs:
            raise ValueError(f"kv_cache_dir {directory} holds KV blocks of another model or cache layout "
                             f"({'; '.join(differs)}): use another directory or empty this one")
    else:
        _write_private(identity_file, json.dumps(identity, indent=1).encode())
    root_file = path / ROOT_FILE
    if not root_file.exists():
        _write_private(root_file, secrets.token_bytes(32))
    root_hash = root_file.read_bytes()
    if len(root_hash) != 32:
        raise ValueError(f"kv_cache_dir {directory}: {ROOT_FILE} is damaged ({len(root_hash)} bytes, not 32); "
                         "empty the directory")
    return root_hash


def _temporary_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_private(path: Path, *parts: bytes | memoryview) -> None:
    """Writes a 0600 file whole or not at all (a temporary name, then a rename)."""
    temporary = _temporary_path(path)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            for part in parts:
                handle.write(part)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def _hold_mid_write(path: Path, data: bytes, fifo: str) -> None:
    """The test hook: half of the file under its temporary name, then a word through the FIFO, then no more."""
    with open(_temporary_path(path), "wb") as handle:
        handle.write(data[:len(data) // 2])
        handle.flush()
        os.fsync(handle.fileno())
    with open(fifo, "w") as signal:
        signal.write(f"{path.name}\n")
    threading.Event().wait()


def _block_rows(kv_caches: list[tuple[CacheTensor, CacheTensor]]) -> list[torch.Tensor]:
    """Every cache tensor as [blocks, bytes of one block] (views: a write lands in the pool): per layer K then V,
    each with its scales if it has them. A block's payload is its row of each, in this order."""
    return [tensor.view(tensor.shape[0], -1).view(torch.uint8)
            for layer in kv_caches for cache in layer for tensor in (cache.data, cache.scales) if tensor is not None]


def copy_blocks_out(kv_caches: list[tuple[CacheTensor, CacheTensor]], block_ids: list[int]) -> torch.Tensor:
    """The blocks' bytes, copied now to host memory, one row per block (the caller may overwrite the blocks
    right after): one gather per cache tensor, however many blocks."""
    rows = _block_rows(kv_caches)
    index = torch.tensor(block_ids, dtype=torch.int64, device=rows[0].device)
    return torch.cat([tensor.index_select(0, index) for tensor in rows], dim=1).cpu()


def copy_blocks_in(kv_caches: list[tuple[CacheTensor, CacheTensor]], block_ids: list[int],
                   payloads: torch.Tensor) -> None:
    """Writes rows that copy_blocks_out made (or read back from files) into blocks of the pool."""
    rows = _block_rows(kv_caches)
    index = torch.tensor(block_ids, dtype=torch.int64, device=rows[0].device)
    offset = 0
    for tensor in rows:
        width = tensor.shape[1]
        tensor.index_copy_(0, index, payloads[:, offset:offset + width].to(tensor.device))
        offset += width


class DiskKVStore:
    def __init__(self, directory: str, payload_bytes: int, read_ahead_blocks: int = 0):
        """payload_bytes: one block's K/V (and scales), every layer, as the pool holds it; read_ahead_blocks: the
        most blocks read ahead and kept in memory for loads to come (kv_read_ahead.py)."""
        self.directory = Path(directory)
        self.payload_bytes = payload_bytes
        self.bytes_read = 0
        self.bytes_written = 0
        self.stale_files_removed = 0   # at start-up: half-written temporary files and an earlier process's swaps
        self._swap_secret = secrets.token_bytes(16)   # this process's swap files are checked against it
        self._pending: dict[str, tuple[bytes, torch.Tensor]] = {}   # file name -> (digest, payload) not yet on disk
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._hold_fifo = os.environ.get(HOLD_MID_WRITE_ENV)
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()
        self._read_ahead = ReadAhead(self._read, read_ahead_blocks)

    @staticmethod
    def _block_name(block_hash: bytes) -> str:
        return block_hash.hex() + BLOCK_SUFFIX

    @staticmethod
    def _swap_name(key: int) -> str:
        return f"swap-{key}{SWAP_SUFFIX}"

    def _swap_digest(self, key: int) -> bytes:
        return hashlib.sha256(self._swap_secret + key.to_bytes(8, "little")).digest()

    def list_blocks(self) -> list[tuple[bytes, bytes]]:
        """(hash, key digest) of every complete block file, least recently used first; removes temporary
        files left by a process that died mid-write, swap files of an earlier process, and files of the
        wrong length."""
        found = []
        for file in self.directory.iterdir():
            if file.name.endswith((".tmp", SWAP_SUFFIX)):
                file.unlink(missing_ok=True)
                self.stale_files_removed += 1
                continue
            if not file.name.endswith(BLOCK_SUFFIX):
                continue
            try:
                stat = file.stat()
                with open(file, "rb") as handle:
                    magic, digest, length, _ = HEADER.unpack(handle.read(HEADER_BYTES))
                block_hash = bytes.fromhex(file.name.removesuffix(BLOCK_SUFFIX))
            except (OSError, ValueError, struct.error):
                file.unlink(missing_ok=True)
                self.stale_files_removed += 1
                continue
            if magic != MAGIC or length != self.payload_bytes or stat.st_size != HEADER_BYTES + length:
                file.unlink(missing_ok=True)
                self.stale_files_removed += 1
                continue
            found.append((stat.st_atime_ns, stat.st_mtime_ns, block_hash, digest))
        found.sort()
        return [(block_hash, digest) for *_, block_hash, digest in found]

    def write(self, block_hash: bytes, digest: bytes, payload: torch.Tensor) -> None:
        """Queues a copied-out block for the writer; until written, loads read it from memory."""
        self._queue_write(self._block_name(block_hash), digest, payload)

    def delete(self, block_hash: bytes) -> None:
        self._read_ahead.forget(self._block_name(block_hash))
        self._queue.put(("delete", self._block_name(block_hash)))

    def read_ahead(self, block_hash: bytes, digest: bytes) -> None:
        """Starts reading the block's file in the background for a load to come (nothing if it is queued for
        writing: it is in memory already)."""
        name = self._block_name(block_hash)
        with self._lock:
            if name in self._pending:
                return
        self._read_ahead.ask(name, digest)

    def read(self, block_hash: bytes, digest: bytes) -> torch.Tensor | None:
        """The block's payload; None (and the file removed) when it is missing, is for another key, or fails
        its length or checksum."""
        return self._payload(self._block_name(block_hash), digest)

    def write_swap(self, key: int, payload: torch.Tensor) -> None:
        """Queues a swapped-out block's copy for the writer (read back from memory until written)."""
        self._queue_write(self._swap_name(key), self._swap_digest(key), payload)

    def read_swap(self, key: int) -> torch.Tensor | None:
        """A swapped block's payload, its file deleted; None when it cannot be read."""
        payload = self._payload(self._swap_name(key), self._swap_digest(key))
        self.delete_swap(key)
        return payload

    def delete_swap(self, key: int) -> None:
        self._queue.put(("delete", self._swap_name(key)))

    def _queue_write(self, name: str, digest: bytes, payload: torch.Tensor) -> None:
        with self._lock:
            self._pending[name] = (digest, payload)
        self._queue.put(("write", name))

    def _payload(self, name: str, digest: bytes) -> torch.Tensor | None:
        """From memory while the write is queued or once read ahead, else from the file."""
        with self._lock:
            pending = self._pending.get(name)
        if pending is not None and pending[0] == digest:
            return pending[1]
        payload = self._read_ahead.take(name, digest)
        return payload if payload is not None else self._read(name, digest)

    def _read(self, name: str, digest: bytes) -> torch.Tensor | None:
        path = self.directory / name
        try:
            with open(path, "rb", buffering=0) as handle:
                data = bytearray(os.fstat(handle.fileno()).st_size)
                handle.readinto(data)
        except OSError:
            return None
        problem = None
        if len(data) < HEADER_BYTES:
            problem = f"{len(data)} bytes, shorter than its header"
        else:
            magic, recorded_digest, length, crc = HEADER.unpack_from(data)
            payload = memoryview(data)[HEADER_BYTES:]
            if magic != MAGIC or recorded_digest != digest:
                problem = "another format or key"
            elif length != self.payload_bytes or len(payload) != length:
                problem = f"{len(payload)} payload bytes, {self.payload_bytes} expected"
            elif zlib.crc32(payload) != crc:
                problem = "checksum mismatch"
        if problem is not None:
            logger.warning("KV block file %s refused (%s); its tokens are recomputed", path.name, problem)
            path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):   # (deleted meanwhile for the quota: the payload is still right)
            os.utime(path)   # its access time orders the LRU rebuilt at the next start
        with self._lock:   # the read-ahead thread reads too
            self.bytes_read += len(data)
        return torch.frombuffer(data, dtype=torch.uint8, offset=HEADER_BYTES)

    def flush(self) -> None:
        """Returns once every queued write, delete and read-ahead is done."""
        self._queue.join()
        self._read_ahead.flush()

    def close(self) -> None:
        self.flush()
        self._read_ahead.close()
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                action, name = item
                if action == "delete":
                    with self._lock:
                        self._pending.pop(name, None)
                    (self.directory / name).unlink(missing_ok=True)
                else:
                    self._write_pending(name)
            except OSError as error:   # a full or failing disk: the block stays in RAM only, no request fails
                logger.warning("KV disk tier: %s; the block is not kept on disk", error)
            finally:
                self._queue.task_done()

    def _write_pending(self, name: str) -> None:
        with self._lock:
            entry = self._pending.get(name)
        if entry is None:
            return
        digest, payload = entry
        data = memoryview(payload.numpy())   # no copy: the row stays unchanged while it is queued
        header = HEADER.pack(MAGIC, digest, len(data), zlib.crc32(data))
        try:
            if self._hold_fifo:
                _hold_mid_write(self.directory / name, header + data.tobytes(), self._hold_fifo)
            _write_private(self.directory / name, header, data)
            self.bytes_written += len(header) + len(data)
        finally:
            with self._lock:
                if self._pending.get(name) is entry:
                    del self._pending[name]
