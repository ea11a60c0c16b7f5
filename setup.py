"""Builds the CPU kernels (csrc/) at install time; pagedllm falls back to plain PyTorch without them.

On x86-64 the same sources are built once per instruction set (pagedllm._C for any x86-64 CPU,
_C_avx2, _C_avx512, _C_avx512vnni, _C_avx512bf16), and pagedllm/model/kernels.py imports the best one the CPU
running it supports: a build made on one machine runs, and runs fast, on another. Elsewhere
only pagedllm._C is built, for the compiler's default target.

pagedllm._C_cpu_features (csrc/cpu_features.c, plain C, no torch) tells which variants the running CPU can
run, so a build may hold any subset of them.

Install with `pip install --no-build-isolation -e .` so the build uses the torch that is
already installed (an isolated build would fetch another, much larger, torch).
PAGEDLLM_BUILD_VARIANTS=host builds only the best variant this CPU runs (scripts/setup.sh does, for a
first answer in minutes); a list such as "_C,_C_avx2" builds those.
"""
import os
import platform
import runpy

from setuptools import Extension, setup

SOURCES = ["csrc/bindings.cpp", "csrc/paged_attention.cpp", "csrc/prefill_attention.cpp", "csrc/cascade_attention.cpp",
           "csrc/layer_ops.cpp", "csrc/sampler_ops.cpp", "csrc/quant_linear.cpp",
           "csrc/quant_matmul.cpp", "csrc/lora_sgmv.cpp", "csrc/decode_layers.cpp", "csrc/brgemm_tiles.cpp"]
_AVX2 = ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]                                  # x86-64-v3
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd"]   # x86-64-v4
# Variant name -> compiler flags; the names match pagedllm/model/kernels.py.
X86_VARIANTS = {"_C": [], "_C_avx2": _AVX2, "_C_avx512": _AVX512, "_C_avx512vnni": _AVX512 + ["-mavx512vnni"],
                "_C_avx512bf16": _AVX512 + ["-mavx512bf16", "-mavx512vnni"]}


def host_variants() -> list[str]:
    """The best variant this CPU can run, by the feature table pagedllm picks variants with at import
    (pagedllm/model/isa_variants.py), read against /proc/cpuinfo's flags."""
    table = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pagedllm/model/isa_variants.py"))
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("flags"))
    except (OSError, StopIteration):   # no /proc (not Linux): every variant
        return list(X86_VARIANTS)
    features = {flag.replace("_", "") for flag in line.split(":", 1)[1].split()}
    best = next((variant for variant, needs in table["VARIANTS"].items() if needs <= features), "generic")
    return [table["extension_name"](best)]


def extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:   # no torch at build time: pure-PyTorch paths only
        return [], {}

    class BuildEachVariantApart(BuildExtension):
        """The variants compile the same sources with other flags: each gets its own object folder."""

        def build_extension(self, ext):
            shared_temp = self.build_temp
            self.build_temp = os.path.join(shared_temp, ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared_temp

    # -fopenmp: at::parallel_for in the kernels runs on torch's OpenMP threads (without it, on one).
    # -ffp-contract=fast: a * b + c as one FMA instruction (ISO C++ mode would not fuse them).
    # -g0: Python's CFLAGS ask for debug info, which doubled the compile time (measured: 79 s -> 44 s
    # of CPU for prefill_attention.cpp).
    flags = ["-O3", "-g0", "-std=c++17", "-ffp-contract=fast", "-fopenmp"]
    x86 = platform.machine() in ("x86_64", "AMD64")
    variants = X86_VARIANTS if x86 else {"_C": []}
    chosen = os.environ.get("PAGEDLLM_BUILD_VARIANTS")
    if chosen == "host" and x86:
        variants = {name: variants[name] for name in host_variants()}
    elif chosen and chosen != "host":   # development: e.g. "_C,_C_avx2" builds only those
        variants = {name: variants[name] for name in chosen.split(",")}
    exts = [CppExtension(f"pagedllm.{name}", SOURCES, extra_compile_args=flags + isa_flags,
                         extra_link_args=["-fopenmp"]) for name, isa_flags in variants.items()]
    exts.append(Extension("pagedllm._C_cpu_features", ["csrc/cpu_features.c"]))
    return exts, {"build_ext": BuildEachVariantApart}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
