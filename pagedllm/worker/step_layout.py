"""One forward pass's flat layout from per-row block tables, cached-context lengths and new-token counts:
positions, slot mapping and the attention metadata, by array ops. The target model's step and the draft
model's passes (speculative decoding) build theirs the same way."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.model.attention import AttentionMetadata


@dataclass
class StepLayout:
    token_row: np.ndarray      # [tokens] which row each flat token belongs to
    positions: np.ndarray      # [tokens]
    row_ends: np.ndarray       # [rows] one past each row's last flat token
    meta: AttentionMetadata


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device)


def build_layout(block_tables: np.ndarray, context: np.ndarray, num_new: np.ndarray, block_size: int,
                 device: torch.device, use_kernel: bool) -> StepLayout:
    """Rows must come single-token rows (decodes) first, as the attention kernels take them; row i computes
    positions context[i] .. context[i] + num_new[i] - 1 through block_tables[i]."""
    row_ends = np.cumsum(num_new)
    row_starts = row_ends - num_new
    num_tokens = int(row_ends[-1])
    token_row = np.repeat(np.arange(len(num_new)), num_new)
    positions = np.arange(num_tokens) - row_starts[token_row] + context[token_row]
    slot_mapping = block_tables[token_row, positions // block_size] * block_size + positions % block_size

    num_decodes = int((num_new == 1).sum())
    seq_lens = context + num_new
    decode_blocks = -(-int(seq_lens[:num_decodes].max()) // block_size) if num_decodes else 0
    tables = to_device(block_tables, device)
    meta = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        num_decode_tokens=num_decodes,
        decode_block_tables=tables[:num_decodes, :decode_blocks].contiguous(),
        decode_seq_lens=to_device(seq_lens[:num_decodes], device),
        prefill_query_starts=to_device(np.append(row_starts[num_decodes:], num_tokens), device),
        prefill_context_lens=to_device(context[num_decodes:], device),
        prefill_block_tables=tables[num_decodes:],
        block_size=block_size,
        use_kernel=use_kernel,
    )
    return StepLayout(token_row, positions, row_ends, meta)
