"""`pagedllm bench cascade`: the shared-prefix (cascade) kernel against the plain decode kernel, per group
size and shared length: where cascade attention starts to pay (model/cascade.py's thresholds).

One layer of the bundled model's attention shape (9 query heads on 3 kv heads of 64), decodes whose block
tables share their first blocks and then hold a few blocks of their own; the best of --reps calls each.
"""
from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--group-sizes", default="2,4,8,64", help="comma-separated sequences per group")
    parser.add_argument("--shared-lens", default="32,64,128,256,1024", help="comma-separated shared keys")
    parser.add_argument("--own-len", type=int, default=20, help="keys of each sequence's own after the prefix")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="queries and KV cache")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the least noise on a shared machine)")
    parser.add_argument("--reps", type=int, default=40)


def _best_seconds(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def run(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.model import kernels
    from pagedllm.model.attention.cache import kv_cache_shapes
    from pagedllm.model.cascade import find_shared_prefixes

    if kernels.kernels is None:
        raise SystemExit("the C++ kernels are not built: nothing to measure")
    _C = kernels.kernels
    torch.set_num_threads(args.threads)
    dtype, block_size, heads, kv_heads, head_dim = getattr(torch, args.dtype), args.block_size, 9, 3, 64
    print(f"CPU kernels {kernels.variant}, {args.dtype}, {args.threads} thread(s), blocks of {block_size}, "
          f"{args.own_len} own keys per sequence; plain decode kernel / cascade kernel, µs per call")
    print("| sequences | shared keys | plain µs | cascade µs | speed-up |")
    print("|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for size in (int(n) for n in args.group_sizes.split(",")):
        for shared in (int(n) for n in args.shared_lens.split(",")):
            shared_blocks, own_blocks = -(-shared // block_size), -(-(args.own_len + 1) // block_size)
            num_blocks = shared_blocks + size * own_blocks
            k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, head_dim)
            k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for shape in (k_shape, v_shape))
            own = torch.randperm(num_blocks - shared_blocks, generator=generator) + shared_blocks
            tables = torch.cat([torch.arange(shared_blocks).expand(size, -1), own.view(size, own_blocks)], 1)
            contexts = torch.full((size,), shared + args.own_len)
            q = torch.randn(size, heads, head_dim, generator=generator).to(dtype)
            out = torch.empty_like(q)
            groups = find_shared_prefixes(tables.numpy(), contexts.numpy(), block_size, 1, 2)
            rows, starts = torch.arange(size), torch.arange(size + 1)
            plain = _best_seconds(lambda: _C.paged_attention(out, q, k_cache, v_cache, None, None, tables, rows,
                                                             contexts + 1, 0.125), args.reps)
            cascade = _best_seconds(lambda: _C.cascade_attention(
                out, q, k_cache, v_cache, None, None, tables, starts, contexts, groups.group_seqs,
                groups.group_starts, groups.shared_lens, 0.125), args.reps)
            print(f"| {size} | {shared} | {plain * 1e6:.1f} | {cascade * 1e6:.1f} | {plain / cascade:.2f}x |")
