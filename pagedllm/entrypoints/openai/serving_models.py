"""The LoRA adapters a server serves by model name: ids assigned here (1, 2, ... never reused), each adapter
loaded into the engine (every Ray replica's) before its name answers, and removed only when nothing runs it;
and vLLM's routes that load and unload them at run time (mounted only when runtime updates are allowed)."""
from __future__ import annotations

import itertools
import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedllm.entrypoints.openai.response_protocol import ERROR_RESPONSES
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.lora.request import LoRAInUseError, LoRARequest

logger = logging.getLogger(__name__)
runtime_updates_router = APIRouter()


class ServedAdapters:
    def __init__(self, llm: EngineClient, base_model_names: list[str]):
        self._llm = llm
        self._base_model_names = base_model_names
        self._by_name: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()   # names whose load is under way: a second load of one is a duplicate
        self._next_id = itertools.count(1)

    def all(self) -> list[LoRARequest]:
        """The served adapters in the order they were loaded."""
        return list(self._by_name.values())

    def parent_of(self, adapter: LoRARequest) -> str:
        return adapter.base_model_name or self._base_model_names[0]

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Loads the adapter into the engine under a new id and serves it as `name`. APIError 400: no name or
        path, a name already served (base model or adapter), or an adapter the engine refuses (the reason)."""
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_path" if name else "lora_name")
        if name in self._base_model_names:
            raise APIError(400, f"'{name}' is a base model's name; give the adapter another", param="lora_name")
        if name in self._by_name or name in self._loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if base_model_name is not None and base_model_name not in self._base_model_names:
            raise APIError(400, f"base_model_name {base_model_name!r} is not a served base model; this server "
                                f"serves {', '.join(map(repr, self._base_model_names))}", param="base_model_name")
        adapter = LoRARequest(name, next(self._next_id), path, base_model_name)
        self._loading.add(name)
        try:
            await self._llm.add_lora(adapter)
        except ValueError as exc:   # no such folder, not a PEFT adapter, shapes or rank the base cannot take
            raise APIError(400, f"LoRA adapter '{name}' cannot be loaded from {path!r}: {exc}",
                           param="lora_path") from exc
        finally:
            self._loading.discard(name)
        self._by_name[name] = adapter
        logger.info("loaded LoRA adapter %r (id %d) from %s", name, adapter.lora_int_id, path)
        return adapter

    async def unload(self, name: str, lora_int_id: int | None = None) -> None:
        """Stops serving the adapter and drops it from the engine. APIError 404 for a name not served,
        409 while unfinished requests run with it (they carry on, untouched)."""
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        adapter = self._by_name.get(name)
        if adapter is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        if lora_int_id is not None and lora_int_id != adapter.lora_int_id:
            raise APIError(400, f"lora_int_id {lora_int_id} is not the id of the lora adapter '{name}' "
                                f"({adapter.lora_int_id}); leave it out or send that", param="lora_int_id")
        try:
            await self._llm.remove_lora(adapter.lora_int_id)
        except LoRAInUseError as exc:
            raise APIError(409, f"The lora adapter '{name}' is in use: {exc}; unload it once its requests "
                                "have finished", param="lora_name", code="lora_adapter_in_use") from exc
        del self._by_name[name]
        logger.info("unloaded LoRA adapter %r (id %d)", name, adapter.lora_int_id)


@runtime_updates_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                             responses={200: {"description": "Success: LoRA adapter 'NAME' added successfully."},
                                        **ERROR_RESPONSES})
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> str:
    check_undeclared_fields(body)
    await _adapters(request).load(body.lora_name, body.lora_path)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@runtime_updates_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                             responses={200: {"description": "Success: LoRA adapter 'NAME' removed successfully."},
                                        **ERROR_RESPONSES})
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> str:
    check_undeclared_fields(body)
    await _adapters(request).unload(body.lora_name, body.lora_int_id)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _adapters(request: Request) -> ServedAdapters:
    return request.app.state.server.adapters
