"""Random PEFT adapters for the tiny test models, made by peft itself and saved as PEFT folders (no download)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="peft is needed for the LoRA tests (pip install -e '.[test]')")
from transformers import AutoModelForCausalLM  # noqa: E402

from pagedllm.lora.request import LoRARequest  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# Three adapters that differ in rank, targets and scaling: all-linear, attention-only, MLP-only with rsLoRA.
THREE_KINDS = [dict(rank=8, targets="all-linear"), dict(rank=16, targets=["q_proj", "v_proj", "o_proj"]),
               dict(rank=4, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True)]


def make_adapter(base_dir: Path, out_dir: Path, *, rank: int = 8, targets=ATTENTION, alpha: int = 16,
                 use_rslora: bool = False, seed: int = 0, safe_serialization: bool = True, **extra) -> Path:
    """A LoRA of the given rank on `targets` (a list, or "all-linear") with random A and B (PEFT's default B is zero,
    which would make the adapter a no-op), saved with save_pretrained."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                             init_lora_weights=False, lora_dropout=0.0, **extra)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2 if "lora_B" in name else 0.5 / rank ** 0.5)
    model.save_pretrained(out_dir, safe_serialization=safe_serialization)
    return out_dir


def three_adapter_requests(base_dir: Path, folder: Path) -> list[LoRARequest]:
    """THREE_KINDS made over base_dir into folder, as requests adapter-0..2 with ids 1..3."""
    return [LoRARequest(f"adapter-{i}", i + 1, str(make_adapter(base_dir, folder / f"a{i}", seed=i, **kind)))
            for i, kind in enumerate(THREE_KINDS)]


def reference_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' model with peft's adapter applied (unmerged), float32, eval mode."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens (EOS not stopping) and each step's log-probabilities over the vocabulary."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=0, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
