"""Builds the CPU kernels (csrc/, as pagedllm._C) at install time; pagedllm falls back to plain PyTorch without them.

Install with `pip install --no-build-isolation -e .` so the build uses the torch that is
already installed (an isolated build would fetch another, much larger, torch).
"""
import os
import platform

from setuptools import setup


def extensions():
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:   # no torch at build time: pure-PyTorch paths only
        return [], {}
    # -fopenmp: at::parallel_for in the kernels runs on torch's OpenMP threads (without it, on one).
    # -ffp-contract=fast: a * b + c as one FMA instruction (ISO C++ mode would not fuse them).
    flags = ["-O3", "-std=c++17", "-ffp-contract=fast", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64") and os.environ.get("PAGEDLLM_PORTABLE") != "1":
        flags.append("-march=native")   # AVX-512 where the building machine has it
    sources = ["csrc/bindings.cpp", "csrc/paged_attention.cpp", "csrc/prefill_attention.cpp", "csrc/layer_ops.cpp",
               "csrc/sampler_ops.cpp"]
    ext = CppExtension("pagedllm._C", sources, extra_compile_args=flags, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
