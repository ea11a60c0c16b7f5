"""A worker's adapters: up to max_cpu_loras loaded (an LRU, packed for this rank), of which up to max_loras sit in
the model's slots for a step. A step's adapters are made resident before its forward pass; an adapter evicted from
the LRU is read again from its folder when a request needs it (vLLM's behaviour).

A slot holds a copy of its adapter in each layer's stacked tensors (StackedLoRA), so that one kernel call reads every
slot: activating an adapter copies its weights once (the size of the adapter), and max_loras bounds the segments a
step runs.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from pagedllm.config.lora import LoRAConfig
from pagedllm.lora.layer import LoRAModel
from pagedllm.lora.peft_checkpoint import load_peft_adapter
from pagedllm.lora.punica import NO_SLOT, LoRASegments, PackedLoRA
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAWorkerManager:
    def __init__(self, lora_model: LoRAModel, lora_config: LoRAConfig):
        self.lora_model = lora_model
        self.config = lora_config
        self.loaded: OrderedDict[int, dict[tuple[int, str], PackedLoRA]] = OrderedDict()   # least recently used first
        self.requests: dict[int, LoRARequest] = {}    # every adapter a request has named: how to load it again
        self.slot_adapters: list[int | None] = [None] * lora_config.max_loras
        self.slot_last_used = [0] * lora_config.max_loras
        self.num_steps = 0
        # The last step's token adapter ids and the slots and adapters it used: a step with the same ids (every
        # decode step of an unchanged batch) keeps the model's row grouping as it is.
        self.last_step: tuple[bytes, list[int], list[int]] | None = None

    def add(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter (ValueError naming the reason if it cannot serve this base); False if it was loaded."""
        lora_id = lora_request.lora_int_id
        self.requests[lora_id] = lora_request
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)
            return False
        adapter = load_peft_adapter(lora_request, self.lora_model.config, self.config)
        self.loaded[lora_id] = self.lora_model.pack(adapter)
        logger.info("LoRA adapter %r (id %d) loaded from %s: rank %d on %d projections, %s",
                    lora_request.lora_name, lora_id, lora_request.lora_path, adapter.rank, len(adapter.modules),
                    str(self.lora_model.dtype).removeprefix("torch."))
        while len(self.loaded) > self.config.max_cpu_loras:
            self._drop(next(iter(self.loaded)))
        return True

    def remove(self, lora_id: int) -> bool:
        """Forgets the adapter; False if it was not loaded."""
        self.requests.pop(lora_id, None)
        if lora_id not in self.loaded:
            return False
        self._drop(lora_id)
        return True

    def list(self) -> set[int]:
        return set(self.loaded)

    def note(self, lora_request: LoRARequest | None) -> None:
        """A request joining the batch with this adapter: remembered, so that it can be loaded again if evicted."""
        if lora_request is not None:
            self.requests.setdefault(lora_request.lora_int_id, lora_request)

    def _drop(self, lora_id: int) -> None:
        del self.loaded[lora_id]
        self.last_step = None
        if lora_id in self.slot_adapters:
            slot = self.slot_adapters.index(lora_id)
            self.slot_adapters[slot] = None
            self.lora_model.set_slot(slot, {})

    def prepare_step(self, token_lora_ids: np.ndarray) -> None:
        """Makes the step's adapters resident and groups its token rows by slot for every LoRA layer."""
        self.num_steps += 1
        key = token_lora_ids.tobytes()
        if self.last_step is not None and self.last_step[0] == key:
            _, needed, slots = self.last_step
            for lora_id in needed:
                self.loaded.move_to_end(lora_id)
            for slot in slots:
                self.slot_last_used[slot] = self.num_steps
            return
        needed = [int(lora_id) for lora_id in np.unique(token_lora_ids) if lora_id]
        if len(needed) > len(self.slot_adapters):
            raise RuntimeError(f"a step with {len(needed)} adapters, over max_loras {len(self.slot_adapters)}")
        for lora_id in needed:
            if lora_id in self.loaded:
                self.loaded.move_to_end(lora_id)
        for lora_id in needed:
            if lora_id not in self.loaded:
                self.add(self.requests[lora_id])
        slot_of = {}
        for lora_id in needed:
            if lora_id in self.slot_adapters:
                slot_of[lora_id] = self.slot_adapters.index(lora_id)
                self.slot_last_used[slot_of[lora_id]] = self.num_steps
        for lora_id in needed:
            if lora_id not in slot_of:
                slot = self._free_slot(set(slot_of.values()))
                self.slot_adapters[slot] = lora_id
                self.lora_model.set_slot(slot, self.loaded[lora_id])
                self.slot_last_used[slot] = self.num_steps
                slot_of[lora_id] = slot
        lookup = np.full(max(needed, default=0) + 1, NO_SLOT, np.int64)
        for lora_id, slot in slot_of.items():
            lookup[lora_id] = slot
        self.lora_model.set_step(LoRASegments.of(lookup[token_lora_ids], self.lora_model.device))
        self.last_step = (key, needed, list(slot_of.values()))

    def _free_slot(self, taken: set[int]) -> int:
        """An empty slot, else the least recently used one this step does not need."""
        candidates = [slot for slot in range(len(self.slot_adapters)) if slot not in taken]
        empty = [slot for slot in candidates if self.slot_adapters[slot] is None]
        return empty[0] if empty else min(candidates, key=self.slot_last_used.__getitem__)
