"""One build, every x86-64 CPU: the kernel variant is chosen at import from the CPU's features, and each
variant this machine can run passes the kernel tests (which hold every kernel to its PyTorch formula)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.config.resolve import resolve_dtype
from pagedllm.model import kernels

pytestmark = pytest.mark.kernels

SUBPROCESS_TIMEOUT = 1800   # seconds: a hung child fails the test instead of hanging the suite
# The tests that compare every compiled kernel with its PyTorch reference.
KERNEL_TESTS = ["tests/model/test_layer_ops.py", "tests/model/test_attention.py",
                "tests/model/test_cascade_attention.py",
                "tests/model/test_prefill_paths.py::test_prefill_paths_match_dense_attention_within_the_bfloat16_bound",
                "tests/model/test_prefill_paths.py::test_prefill_paths_keep_sliding_windows_and_soft_caps",
                "tests/model/test_prefill_paths.py::test_float_queries_match_dense_attention",
                "tests/worker/test_sampling.py::test_logits_summary_kernel_matches_logsumexp_and_argmax",
                "tests/worker/test_sampling.py::test_top_k_top_p_keep_the_tokens_their_definition_keeps",
                "tests/worker/test_logit_controls.py::"
                "test_greedy_rows_under_controls_take_the_argmax_of_the_controlled_logits_and_leave_the_raw_ones",
                "tests/worker/test_token_bitmask.py",
                "tests/model/test_quantization.py::test_repack_is_exact_against_gguf",
                "tests/model/test_quantization.py::test_quantized_linear_against_float_reference",
                "tests/model/test_quantization.py::test_quantized_linear_in_bfloat16",
                "tests/model/test_quantization.py::test_float_sums_of_bfloat16_activations_against_float_reference",
                "tests/model/test_quantization.py::test_batch_invariant_rows_do_not_depend_on_the_batch_they_share",
                "tests/lora/test_punica.py"]
ROOT = Path(__file__).resolve().parents[2]


def test_the_best_variant_the_cpu_supports_is_chosen():
    supported = kernels.supported_variants()
    assert "generic" in supported
    if not os.environ.get(kernels.FORCE_VARIABLE):
        assert kernels.variant == supported[0]
    features = kernels.cpu_features()
    for variant in supported:
        assert kernels.VARIANTS[variant] <= features


def test_the_cpu_features_are_those_linux_reports():
    """The probe (pagedllm._C_cpu_features, what variants are chosen by) against the kernel's view of the CPU:
    /proc/cpuinfo's flags, among those some variant needs."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    flags_line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    reported = {flag.replace("_", "") for flag in flags_line.split(":", 1)[1].split()}
    needed = set().union(*kernels.VARIANTS.values())
    assert kernels.cpu_features() == needed & reported


def test_dtype_auto_is_bfloat16_exactly_where_the_cpu_multiplies_bfloat16_in_hardware():
    """AVX512-BF16 or AMX, as /proc/cpuinfo names them. oneDNN also accepts bfloat16 on AVX-512 without BF16
    (Cascade Lake, Ice Lake) by widening it to float32: slower than float32, so auto must not pick it there."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo (not Linux)")
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch is built without oneDNN: auto is float32 on every CPU")
    flags_line = next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags"))
    flags = set(flags_line.split(":", 1)[1].split())
    expected = torch.bfloat16 if flags & {"avx512_bf16", "amx_bf16"} else torch.float32
    assert resolve_dtype("auto", None, torch.device("cpu")) == expected


def test_forcing_a_variant_the_cpu_lacks_or_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="PAGEDLLM_ISA must be one of avx512bf16, avx512vnni, avx512, avx2, generic"):
        kernels.load("sse9")
    missing = [variant for variant in kernels.VARIANTS if variant not in kernels.supported_variants()]
    for variant in missing:
        with pytest.raises(ValueError, match="this CPU or build cannot run it"):
            kernels.load(variant)


# Run under each variant: the int16 path's results on fixed inputs (8-bit weights without mins, 4-bit with them;
# odd row and output counts, bias; 5 and 13 rows take the VNNI and AVX2 builds' few-row body, 37 their panels),
# saved to argv[1]. 100 outputs are 7 tiles, the last with 4 rows; on 2 threads each thread's 4 and 3 tiles make
# VNNI panels of 3 and 1 tiles and of 3 (a panel's missing tiles and the last tile's missing rows both covered).
_INT16_PROBE = """
import sys
import torch
from pagedllm.model import kernels
from pagedllm.model.quantization import quantize
torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
x = torch.randn(37, 512, generator=generator)
x[0, :7] *= 20
bias = torch.randn(100, generator=generator)
results = {}
for bits in (8, 4):
    weight = quantize(torch.randn(100, 512, generator=generator) * 0.05, bits)
    for rows in (37, 13, 5):
        out = torch.empty(rows, 100)
        kernels.kernels.quantized_linear_int16(out, x[:rows], weight.qweight, weight.scales, weight.mins, bias,
                                               weight.bits, weight.group_size)
        results[bits, rows] = out
torch.save(results, sys.argv[1])
"""


def test_the_int16_path_gives_the_same_bits_on_every_variant(tmp_path):
    """Its group sums are exact integers, folded in the same float operations by every body (VNNI's few-row and
    panel bodies, AVX2's, and the generic build's element-at-a-time loop, the reference here), so each variant gives
    the generic build's bits."""
    variants = kernels.supported_variants()
    if "generic" not in variants or len(variants) < 2:
        pytest.skip("needs the generic build and another variant (scripts/setup.sh --tests builds every variant)")
    results = {}
    for variant in variants:
        path = tmp_path / f"{variant}.pt"
        env = {**os.environ, kernels.FORCE_VARIABLE: variant}
        subprocess.run([sys.executable, "-c", _INT16_PROBE, str(path)], env=env, check=True, timeout=SUBPROCESS_TIMEOUT)
        results[variant] = torch.load(path)
    for variant, outputs in results.items():
        assert outputs.keys() == results["generic"].keys()
        for (bits, rows), out in outputs.items():
            reference = results["generic"][bits, rows]
            assert torch.equal(out, reference), (variant, bits, rows, (out - reference).abs().max())


@pytest.mark.parametrize("variant", [v for v in kernels.supported_variants() if v != kernels.variant])
def test_each_other_variant_passes_the_kernel_tests(variant):
    """The default variant runs them in this process already; the others in a process of their own."""
    env = {**os.environ, kernels.FORCE_VARIABLE: variant}
    check = subprocess.run([sys.executable, "-c", "from pagedllm.model import kernels; print(kernels.kernels.__name__)"],
                           env=env, capture_output=True, text=True, check=True, timeout=SUBPROCESS_TIMEOUT)
    assert check.stdout.strip() == kernels.module_name(variant)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
