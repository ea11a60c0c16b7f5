"""Whether, and for which groups, an engine runs cascade (shared-prefix) attention: enable_cascade_attention's
three settings resolved once at start-up into the rule the runner applies per step (model/cascade.py).

auto (None, the default) times the kernels on the CPU at hand (model/cascade_timing.py) and keeps the groups that
won there; True keeps every group; False none. Off whatever the setting where the cascade cannot or must not run:
without the C++ kernels (CUDA, no build, another attention backend), for models that never decode (pooling: their
prompts run whole, with nothing cached to share), for models whose every layer has a sliding window (the kernel
serves full-attention layers only), and under auto with batch_invariant=True (a row's result would depend on the
group it shares; EngineConfig refuses True there).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.model import kernels
from pagedllm.model.cascade import ALWAYS, CascadeRule
from pagedllm.model.cascade_timing import AttentionShape, CascadeMeasurement, measure_cascade_rule


@dataclass(frozen=True)
class CascadeChoice:
    """What the engine records at start-up (its log line and model_info)."""
    setting: str                   # enable_cascade_attention as configured: auto, on or off
    rule: CascadeRule | None       # the runner's per-step rule; None: the plain kernels always
    reason: str                    # why it is off, or where the rule came from
    measurement: CascadeMeasurement | None = None   # auto's timings

    def describe(self) -> str:
        if self.rule is None:
            return f"off ({self.reason})"
        return f"{self.setting}: {self.reason}"


def setting_name(enabled: bool | None) -> str:
    return "auto" if enabled is None else "on" if enabled else "off"


def why_not_possible(uses_cpu_kernels: bool, backend_name: str, decodes: bool, full_attention_layers: int
                     ) -> str | None:
    """Why the cascade cannot serve this engine at all (None: it can)."""
    if not uses_cpu_kernels:
        return f"attention backend {backend_name}: the cascade kernel is C++ only"
    if not decodes:
        return "a pooling model: prompts run whole, nothing cached is shared"
    if not full_attention_layers:
        return "every attention layer has a sliding window"
    return None


def choose_cascade(enabled: bool | None, batch_invariant: bool, impossible: str | None,
                   shape: AttentionShape) -> CascadeChoice:
    """enabled: EngineConfig.enable_cascade_attention; impossible: why_not_possible's answer; shape: the
    attention of one rank, as auto times it (on this process's torch threads)."""
    setting = setting_name(enabled)
    if enabled is False:
        return CascadeChoice(setting, None, "enable_cascade_attention=False")
    if impossible is not None:
        return CascadeChoice(setting, None, impossible)
    if enabled:
        return CascadeChoice(setting, ALWAYS, "every group of 2+ sequences sharing keys")
    if batch_invariant:
        return CascadeChoice(setting, None, "batch_invariant=True: a row's result would depend on its group")
    measurement = measure_cascade_rule(kernels.kernels, shape)
    return CascadeChoice(setting, measurement.rule, measurement.describe(), measurement)
