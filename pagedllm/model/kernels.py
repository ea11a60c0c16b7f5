"""The compiled CPU kernels: the variant built for the best instruction set this CPU has.

setup.py builds csrc/ once per instruction set on x86-64 (pagedllm._C for any CPU, _C_avx2,
_C_avx512, _C_avx512bf16). The choice is made once, at import, from the features the CPU
reports (`_C.cpu_features()`); the engine logs it. PAGEDLLM_ISA=<name> forces a variant (tests use
it to check each one). `kernels` is None where nothing was built: the PyTorch formulas serve.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

from pagedllm.model.isa_variants import VARIANTS, extension_name

FORCE_VARIABLE = "PAGEDLLM_ISA"


def module_name(variant: str) -> str:
    return f"pagedllm.{extension_name(variant)}"


def supported_variants() -> list[str]:
    """The variants this CPU can run and this build holds, best first (empty without a build)."""
    try:
        generic = importlib.import_module(module_name("generic"))
    except ImportError:
        return []
    features = set(generic.cpu_features())
    found = []
    for variant, needs in VARIANTS.items():
        if needs <= features:
            try:
                importlib.import_module(module_name(variant))
            except ImportError:   # not built here (not x86-64)
                continue
            found.append(variant)
    return found


def load(variant: str) -> ModuleType:
    """One variant's module; ValueError if this CPU cannot run it or it was not built."""
    if variant not in VARIANTS:
        raise ValueError(f"{FORCE_VARIABLE} must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant not in supported_variants():
        raise ValueError(f"{FORCE_VARIABLE}={variant}: this CPU or build cannot run it "
                         f"(it can run: {', '.join(supported_variants()) or 'none'})")
    return importlib.import_module(module_name(variant))


def _choose() -> tuple[str | None, ModuleType | None]:
    forced = os.environ.get(FORCE_VARIABLE)
    if forced:
        return forced, load(forced)
    variants = supported_variants()
    if not variants:
        return None, None
    return variants[0], importlib.import_module(module_name(variants[0]))


variant, kernels = _choose()   # the engine's start-up log line names the variant
