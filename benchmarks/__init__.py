"""Test tooling run from the source tree, not installed with pagedllm: `python -m benchmarks.<suite> ...` from
the repository root (as vLLM's benchmarks/)."""
