"""The kernel variants setup.py builds on x86-64, best first, with the CPU features each needs.

Plain data with no imports, so that setup.py can read it before pagedllm is installed.
"""

VARIANTS: dict[str, frozenset[str]] = {
    "avx512bf16": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                             "avx512cd", "avx512bf16", "avx512vnni"}),
    "avx512vnni": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                             "avx512cd", "avx512vnni"}),
    "avx512": frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                         "avx512cd"}),
    "avx2": frozenset({"avx2", "fma", "f16c", "bmi2"}),
    "generic": frozenset(),
}


def extension_name(variant: str) -> str:
    """The built module's name inside the package: _C for generic, _C_<variant> otherwise."""
    return "_C" if variant == "generic" else f"_C_{variant}"
