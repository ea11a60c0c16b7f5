"""Paged attention: K/V live in blocks, reached through block tables.

`cache` is the cache layout (the tensors, their shapes, the rounding of new K/V), `metadata` a step's layout
and the backend interface, then one module per backend: `cpu` (the C++ kernels, csrc/), `torch_reference`
(gather each row's blocks, SDPA) and `triton_backend` (CUDA); `paged` is what the cpu and torch backends
share (decodes, then prefill chunks). `selector` chooses the backend once per engine.
"""

# Labels of the attention ranges torch.profiler reports (`pagedllm bench throughput --profile-attention`).
DECODE_RANGE, PREFILL_RANGE = "pagedllm::decode_attention", "pagedllm::prefill_attention"
