"""Random LoRA adapters in PEFT's format, made with peft over a model's shapes in a local folder (nothing is
downloaded): what `bench throughput/latency --num-loras` serve, and what the LoRA tests load."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_hf_config(model: str | None):
    """transformers' config of a model folder, a GGUF file, or (None) the bundled model."""
    from transformers import AutoConfig

    from pagedllm.model.loader import bundled_model_path

    path = Path(model) if model else bundled_model_path()
    if path.suffix == ".gguf":
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return AutoConfig.from_pretrained(path)


def make_random_adapters(model: str | None, folder: Path, count: int, rank: int,
                         target_modules: Sequence[str] = ALL_LINEAR, lora_alpha: int | None = None,
                         seed: int = 0) -> list[Path]:
    """`count` adapters of rank `rank` on target_modules, each in folder/adapter-<i>, with A and B both random
    (peft's init_lora_weights=False: a fresh adapter otherwise changes nothing), seeded seed + i. Only the
    model's shapes matter: its weights are random too."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(model_hf_config(model), dtype=torch.float32)
    paths = []
    for index in range(count):
        torch.manual_seed(seed + index)
        adapter = get_peft_model(base, LoraConfig(r=rank, lora_alpha=lora_alpha or 2 * rank,
                                                  target_modules=list(target_modules), init_lora_weights=False))
        path = folder / f"adapter-{index}"
        adapter.save_pretrained(path)
        paths.append(path)
        base = adapter.unload()   # the bare model again, for the next adapter
    return paths
