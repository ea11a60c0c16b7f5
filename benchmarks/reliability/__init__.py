"""The reliability suite: load, soak, faults and fuzzing against a real `pagedllm serve` process.

`python -m benchmarks.reliability.suite` runs it and prints a table; tests/reliability runs its quick variant.
"""
