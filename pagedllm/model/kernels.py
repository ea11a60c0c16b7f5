"""The compiled CPU kernels: the variant built for the best instruction set this CPU has.

setup.py builds csrc/ once per instruction set on x86-64 (pagedllm._C for any CPU, _C_avx2,
_C_avx512, _C_avx512vnni, _C_avx512bf16), all of them or only the one for the building machine. The choice is made
once, at import, from the features the CPU reports (`pagedllm._C_cpu_features`, built beside them, so no
variant is imported to ask); the engine logs it. PAGEDLLM_ISA=<name> forces a variant (tests use
it to check each one). `kernels` is None where nothing was built: the PyTorch formulas serve.

Each op's path is chosen once too: a layer asks `kernel_for` when it is built and keeps what it gets (the
compiled function, or None for the torch formula), so no call checks for the kernels again; every op that
falls to torch is logged once, with the reason. A variant
that was built but does not import is an error, never a quiet fallback. On x86-64 the build is part of the
install (BUILD_REQUIRED): the tests fail there without it.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import platform
from types import ModuleType

import torch  # (also loads libtorch, which the compiled variants link against)

from pagedllm.model.isa_variants import VARIANTS, extension_name

logger = logging.getLogger(__name__)

FORCE_VARIABLE = "PAGEDLLM_ISA"
BUILD_REQUIRED = platform.machine() in ("x86_64", "AMD64")   # setup.py builds the kernels there


def module_name(variant: str) -> str:
    return f"pagedllm.{extension_name(variant)}"


def _import_if_built(variant: str) -> ModuleType | None:
    """The variant's module, None if it was not built; a built one that fails to import raises."""
    name = module_name(variant)
    return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None


def cpu_features() -> set[str]:
    """The instruction sets of this CPU that variants need (empty without a build)."""
    probe = importlib.util.find_spec("pagedllm._C_cpu_features")
    if probe is None:
        built = [variant for variant in VARIANTS if importlib.util.find_spec(module_name(variant)) is not None]
        if built:   # a build from before the probe existed: never a quiet fall to torch
            raise ImportError(f"kernel variants {built} are built but not pagedllm._C_cpu_features, which chooses "
                              "among them: rebuild (bash scripts/setup.sh, or python setup.py build_ext --inplace)")
        return set()
    return set(importlib.import_module(probe.name).cpu_features())


def supported_variants() -> list[str]:
    """The variants this CPU can run and this build holds, best first (empty without a build)."""
    features = cpu_features()
    return [variant for variant, needs in VARIANTS.items()
            if needs <= features and _import_if_built(variant) is not None]


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
_logged_torch_paths: set[tuple[str, str]] = set()


def kernel_for(op: str, device: torch.device, misfit: str | None = None):
    """The compiled `op` for tensors on `device`, or None where the torch formula serves: no build, not a CPU
    device, or the layer's shapes do not fit the kernel (misfit says how). Asked once per layer, when it is
    built; the torch path is logged once per op and reason."""
    reason = ("the C++ kernels are not built" if kernels is None
              else f"a {device.type} device" if device.type != "cpu" else misfit)
    if reason is None:
        return getattr(kernels, op)
    if (op, reason) not in _logged_torch_paths:
        _logged_torch_paths.add((op, reason))
        logger.info("%s: the torch path serves (%s)", op, reason)
    return None
