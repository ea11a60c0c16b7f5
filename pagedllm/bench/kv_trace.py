"""The block map over time, offline: `bench memory --plot` and `bench throughput --trace` write it as
JSON (the block codes of each kept step, as /v1/kv_map's codes) and as a PNG strip (one row per step,
one column per block, time going down), so the paging claims can be seen without a server.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.snapshot import block_codes

MAX_ROWS = 400   # steps kept in a strip; longer runs keep every k-th
# Strip colour by state index: free, cached idle, in use by one, shared by 2, 3, 4+, reserved but empty.
STATE_COLOURS = ["#e8ebef", "#90c2eb", "#66bb6a", "#f0a040", "#d07a20", "#8a4a10", "#f3b7c8"]
STATE_NAMES = ["free", "cached idle", "in use", "shared x2", "shared x3", "shared x4+", "reserved, empty"]
RESERVED_EMPTY = 6


def state_row(codes: np.ndarray) -> np.ndarray:
    """Block codes (ref_count * 2 + cached) as strip colour indices."""
    ref_counts = codes >> 1
    row = np.where(ref_counts > 0, np.minimum(ref_counts, 4) + 1, codes & 1)
    return row.astype(np.int8)


def reserved_row(stored_tokens: list[int], num_blocks: int, block_size: int, reserve_tokens: int) -> np.ndarray:
    """The same sequences in contiguous per-sequence reservations of reserve_tokens (in block-sized cells):
    filled cells, then the reservation's empty rest; sequences past the budget do not fit and are left out."""
    row = np.zeros(num_blocks, dtype=np.int8)
    reserve = -(-reserve_tokens // block_size)
    start = 0
    for tokens in stored_tokens:
        if start + reserve > num_blocks:
            break
        filled = -(-tokens // block_size)
        row[start:start + filled] = 2
        row[start + filled:start + reserve] = RESERVED_EMPTY
        start += reserve
    return row


class KVTrace:
    """Strip rows of one run; as an engine step listener it records the block map after every step."""

    def __init__(self, kv: KVCacheManager | None = None):
        self.kv = kv
        self.rows: list[np.ndarray] = []

    def __call__(self, stats=None) -> None:
        self.record(block_codes(self.kv))

    def record(self, codes: np.ndarray) -> None:
        self.rows.append(state_row(codes))

    def kept(self) -> np.ndarray:
        """Every k-th row so at most MAX_ROWS remain (all of them for short runs)."""
        step = max(1, -(-len(self.rows) // MAX_ROWS))
        return np.stack(self.rows[::step]) if self.rows else np.zeros((0, 0), dtype=np.int8)


def save(path: str | Path, traces: dict[str, KVTrace], block_size: int) -> tuple[Path, Path]:
    """Writes PATH as JSON and PATH with .png as the strips, one panel per trace; returns both paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    path = Path(path)
    json_path, png_path = path.with_suffix(".json"), path.with_suffix(".png")
    json_path.write_text(json.dumps({
        "block_size": block_size, "states": STATE_NAMES,
        "traces": {name: {"num_blocks": int(trace.kept().shape[1]) if trace.rows else 0,
                          "rows": trace.kept().tolist()} for name, trace in traces.items()}}))
    figure, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 5.2), squeeze=False)
    colours = ListedColormap(STATE_COLOURS)
    for axis, (name, trace) in zip(axes[0], traces.items()):
        rows = trace.kept()
        used = np.flatnonzero(rows.any(axis=0)) if rows.size else np.zeros(0)
        if used.size:   # a large pool a run barely touches: draw the blocks it touched (and a margin)
            rows = rows[:, :min(rows.shape[1], int(used[-1] * 1.1) + 8)]
        axis.imshow(rows, cmap=colours, vmin=0, vmax=len(STATE_COLOURS) - 1, aspect="auto",
                    interpolation="nearest")
        axis.set_title(name, fontsize=9)
        axis.set_xlabel("block id")
        axis.set_ylabel("step (time goes down)")
    figure.legend(handles=[Patch(color=c, label=n) for c, n in zip(STATE_COLOURS, STATE_NAMES)],
                  loc="lower center", ncol=len(STATE_NAMES), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return json_path, png_path
