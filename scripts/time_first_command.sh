#!/usr/bin/env bash
# Times the README's first command as a newcomer runs it: a fresh clone of COMMIT (default HEAD) and a new
# venv (its python first on PATH, pip's cache off), then `bash scripts/setup.sh && pagedllm generate ...`,
# each setup step stamped with the time it began. Run it alone on the machine (docs/performance.md).
#   bash scripts/time_first_command.sh [COMMIT] [WORKDIR]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
commit="$(git -C "$repo" rev-parse "${1:-HEAD}")"
work="${2:-$(mktemp -d)}"
rm -rf "$work/clone" "$work/venv"
git clone -q "$repo" "$work/clone"
git -C "$work/clone" checkout -q "$commit"
python3 -m venv "$work/venv"
export PATH="$work/venv/bin:$PATH" PIP_NO_CACHE_DIR=1
cd "$work/clone"
echo "commit $(git rev-parse --short HEAD), $(python3 --version), $(nproc) cores, in $work"
start=$(date +%s.%N)
# bash ignores PS4 from the environment when run as root, so the stamps are set inside.
bash -c 'PS4="+ [\$(date +%T)] "; set -x; . "$0"' scripts/setup.sh
echo "+ [$(date +%T)] pagedllm generate"
pagedllm generate "What is PagedAttention, in one sentence?"
end=$(date +%s.%N)
echo "first command: $(python3 -c "print(f'{$end - $start:.0f}')") s"
