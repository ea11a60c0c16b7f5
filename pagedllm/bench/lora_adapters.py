"""Random LoRA adapters in PEFT's format, made with peft over a model's shapes in a local folder (nothing is
downloaded): what `bench throughput/latency --num-loras` serve, and what the LoRA tests load."""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator, Sequence
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


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """The LoRA flags the benchmarks share: adapters from folders, or random ones made for the run."""
    parser.add_argument("--lora", default=None, metavar="PATH[,PATH...]",
                        help="PEFT adapter folders: measured with them (each request a random one, seeded) beside "
                             "the base alone")
    parser.add_argument("--num-loras", type=int, default=0,
                        help="make this many random adapters over every linear layer of the model (with peft, in a "
                             "temporary folder) and measure with them beside the base alone (default: none)")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the --num-loras adapters (default: 16)")


@contextlib.contextmanager
def lora_requests_from_args(args: argparse.Namespace) -> Iterator[list]:
    """The adapters the flags ask for as LoRARequests (ids 1, 2, ...), or [] for none; random ones live in a
    temporary folder while the context is open."""
    from pagedllm.lora.request import LoRARequest

    if args.lora and args.num_loras:
        raise ValueError("give --lora or --num-loras, not both")
    if args.num_loras < 0:
        raise ValueError(f"--num-loras must be >= 0, got {args.num_loras}")
    with tempfile.TemporaryDirectory(prefix="pagedllm-loras-") as folder:
        if args.num_loras:
            paths = make_random_adapters(args.model, Path(folder), args.num_loras, args.lora_rank)
        else:
            paths = [Path(path) for path in args.lora.split(",")] if args.lora else []
        yield [LoRARequest(path.name, index, str(path)) for index, path in enumerate(paths, start=1)]


def lora_engine_settings(adapters: Sequence) -> dict:
    """Engine settings that keep every adapter resident at once, with the smallest max_lora_rank that takes them."""
    from pagedllm.config import MAX_LORA_RANKS

    rank = max(json.loads((Path(adapter.lora_path) / "adapter_config.json").read_text())["r"] for adapter in adapters)
    max_lora_rank = next((allowed for allowed in MAX_LORA_RANKS if allowed >= rank), rank)
    return dict(enable_lora=True, max_loras=len(adapters), max_cpu_loras=len(adapters), max_lora_rank=max_lora_rank)
