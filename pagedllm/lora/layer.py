"""A base projection plus the LoRA updates of the adapters resident this step; the base runs its own kernel untouched
(float, or quantized GGUF / int8 / int4), and the updates are added to its output.

Tensor parallel: a column-parallel base (q/k/v, gate/up) holds this rank's output columns, so each B is cut by its
rows alike and A is whole; a row-parallel base (o, down) holds this rank's input columns, so each A is cut by its
columns and B is whole: the update is then a partial sum, added before the layer's all-reduce completes it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.lora.peft_checkpoint import LoRAAdapter
from pagedllm.lora.punica import LoRASegments, PackedLoRA, StackedLoRA, add_lora_torch
from pagedllm.model.config import ModelConfig
from pagedllm.model.kernels import kernel_for
from pagedllm.model.moe_config import is_sparse
from pagedllm.model.parallel_linear import RowParallelLinear
from pagedllm.model.tensor_parallel import Shard, num_kv_heads_per_rank, weight_shards

# Our fused layers and the HF projections side by side in their output columns.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class StepLoRA:
    """The current step's row grouping, shared by every LoRA layer of the model; set by the runner before forward."""
    segments: LoRASegments


class LoRALinear(nn.Module):
    """The base projection, then every row's adapter update in one call (the compiled kernel, chosen once here).
    The compiled decode stack (pagedllm/model/decode_stack.py) runs the same two kernels itself: it reads `base`,
    `lora_slots`, `lora_kernel` and `lora_segments()`."""

    def __init__(self, base: nn.Module, stacked: StackedLoRA, step: StepLoRA, device: torch.device):
        super().__init__()
        self.base = base
        self.step = step
        self.stacked = stacked
        self.lora_kernel = kernel_for("lora_sgmv", device)

    @property
    def lora_slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's adapter arguments: every slot's A, B, ranks, and the fused parts' first columns."""
        stacked = self.stacked
        return stacked.a, stacked.b, stacked.ranks, stacked.column_starts

    def lora_segments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's adapter rows grouped by slot (the kernel's rows and segments), or None: no row has one."""
        segments = self.step.segments
        return (segments.rows, segments.table) if segments.count else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        segments = self.step.segments
        if segments.count:
            if self.lora_kernel is not None:
                self.lora_kernel(out, x, *self.lora_slots, segments.rows, segments.table)
            else:
                add_lora_torch(out, x, segments, self.stacked)
        return out


@dataclass(frozen=True)
class LayerPlan:
    """Where a fused layer's parts sit on this rank: each part's output columns, and how its A and B are cut."""
    in_features: int                       # of the layer on this rank
    columns: tuple[int, ...]               # output columns of each part on this rank
    shards: tuple[Shard | None, ...]       # each part's base weight shard (None: whole)

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(sum(self.columns[:index]) for index in range(len(self.columns)))


class LoRAModel:
    """The model's LoRA layers by (layer index, fused name), and how adapters are cut and packed for this rank."""

    def __init__(self, model: nn.Module, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, rank: int, tp_size: int):
        self.config = config
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.step = StepLoRA(LoRASegments.none())
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        self.plans: dict[tuple[int, str], LayerPlan] = {}
        shards = weight_shards(config, rank, tp_size) if tp_size > 1 else {}
        head_dim = config.head_dim
        q_columns = config.num_attention_heads // tp_size * head_dim
        kv_columns = num_kv_heads_per_rank(config, tp_size) * head_dim
        mlp_columns = config.intermediate_size // tp_size
        columns = {"qkv_proj": (q_columns, kv_columns, kv_columns), "o_proj": (config.hidden_size,),
                   "gate_up_proj": (mlp_columns, mlp_columns), "down_proj": (config.hidden_size,)}
        in_features = {"qkv_proj": config.hidden_size, "o_proj": q_columns, "gate_up_proj": config.hidden_size,
                       "down_proj": mlp_columns}
        for index, decoder_layer in enumerate(model.layers):
            owners = {"qkv_proj": decoder_layer, "o_proj": decoder_layer}
            if not is_sparse(config.moe, index):
                owners |= {"gate_up_proj": decoder_layer.mlp, "down_proj": decoder_layer.mlp}
            for fused, owner in owners.items():
                kind = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
                plan = LayerPlan(in_features[fused], columns[fused],
                                 tuple(shards.get(f"model.layers.{index}.{kind}.{part}.weight")
                                       for part in FUSED_PARTS[fused]))
                self.plans[(index, fused)] = plan
                stacked = StackedLoRA(max_loras, max_rank, plan.in_features, plan.columns, dtype, device)
                self.layers[(index, fused)] = self._wrap(owner, fused, stacked)

    def _wrap(self, owner: nn.Module, name: str, stacked: StackedLoRA) -> LoRALinear:
        """Puts a LoRALinear around the projection (inside a row-parallel wrapper, before its all-reduce)."""
        module = getattr(owner, name)
        if isinstance(module, RowParallelLinear):
            owner, name, module = module, "layer", module.layer
        wrapped = LoRALinear(module, stacked, self.step, self.device)
        setattr(owner, name, wrapped)
        return wrapped

    def pack(self, adapter: LoRAAdapter) -> dict[tuple[int, str], PackedLoRA]:
        """This rank's cut of the adapter, in the adapters' dtype on the device, one PackedLoRA per fused layer it
        touches."""
        packed = {}
        for (index, fused), plan in self.plans.items():
            modules = [adapter.modules.get((index, part)) for part in FUSED_PARTS[fused]]
            if all(module is None for module in modules):
                continue
            a = torch.zeros(len(modules) * self.max_rank, plan.in_features, dtype=torch.float32)
            b = torch.zeros(self.max_rank, sum(plan.columns), dtype=torch.float32)
            ranks = torch.zeros(len(modules), dtype=torch.int64)
            for part, (module, column, width, shard) in enumerate(zip(modules, plan.starts, plan.columns, plan.shards)):
                if module is None:
                    continue
                lora_a, lora_b = module.lora_a, module.lora_b
                if shard is not None:
                    lora_a, lora_b = (lora_a, shard.of(lora_b)) if shard.dim == 0 else (shard.of(lora_a), lora_b)
                first = part * self.max_rank
                a[first:first + module.rank] = lora_a
                b[:module.rank, column:column + width] = lora_b.t()
                ranks[part] = module.rank
            packed[(index, fused)] = PackedLoRA(a.to(device=self.device, dtype=self.dtype),
                                                b.to(device=self.device, dtype=self.dtype), ranks.to(self.device))
        return packed

    def set_slot(self, slot: int, packed: dict[tuple[int, str], PackedLoRA]) -> None:
        """Makes slot `slot` of every LoRA layer hold this adapter's update (None where it has none)."""
        for key, layer in self.layers.items():
            layer.stacked.set(slot, packed.get(key))

    def set_step(self, segments: LoRASegments) -> None:
        self.step.segments = segments
