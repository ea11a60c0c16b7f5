"""The FastAPI app (routes, middleware, lifespan) and `run_server`, which `pagedllm serve` calls. It mounts the
OpenAI routes (its own and those of openai/), the Anthropic Messages API (anthropic/) and the dashboard, so it
sits above both API packages."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import sys

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.data_parallel import DPAsyncLLM
from pagedllm.engine.protocol import EngineClient, EngineDeadError
from pagedllm.entrypoints.anthropic.serving import router as messages_router
from pagedllm.entrypoints.openai.auth import APIKeyMiddleware
from pagedllm.entrypoints.openai.body_limit import RequestSizeLimitMiddleware
from pagedllm.entrypoints.openai.dashboard import install_dashboard
from pagedllm.entrypoints.openai.errors import APIError, api_error_for, install_error_handlers
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeChatRequest, TokenizeCompletionRequest)
from pagedllm.entrypoints.openai.response_protocol import (ChatCompletionChunk, ChatCompletionResponse,
                                                           CompletionResponse, DetokenizeResponse, ERROR_RESPONSES,
                                                           ModelCard, ModelList, TokenizeResponse, VersionResponse)
from pagedllm.entrypoints.openai.request_fields import check_undeclared_fields
from pagedllm.entrypoints.openai.responses.serving import router as responses_router
from pagedllm.entrypoints.openai.responses.store import ResponseStore
from pagedllm.entrypoints.openai.lora_modules import LoRAModulePath
from pagedllm.entrypoints.openai.server_config import RUNTIME_LORA_UPDATING_ENV, ServerConfig
from pagedllm.entrypoints.openai.serving_chat import create_chat_completion
from pagedllm.entrypoints.openai.serving_completion import create_completion
from pagedllm.entrypoints.openai.serving_engine import ServerState
from pagedllm.entrypoints.openai.serving_models import ServedAdapters, runtime_updates_router
from pagedllm.entrypoints.openai.serving_pooling import router as pooling_router
from pagedllm.entrypoints.openai.stats_logger import log_stats_periodically
from pagedllm.model.loader import bundled_model_path

logger = logging.getLogger(__name__)

router = APIRouter()


def generation_responses(answer: type, chunk: type) -> dict:
    """A whole answer as JSON or, with stream=true, Server-Sent Events: `data: <chunk>` lines, then `data: [DONE]`."""
    events = {"schema": {"type": "string", "description": f"Server-Sent Events of {chunk.__name__} objects"}}
    return {200: {"model": answer, "content": {"text/event-stream": events}}, **ERROR_RESPONSES}


def _state(request: Request) -> ServerState:
    return request.app.state.server


def pagedllm_version() -> str:
    return importlib.metadata.version("pagedllm")


@router.get("/health", response_class=Response, responses={200: {"description": "The server is up (empty body)"},
                                                            **ERROR_RESPONSES})
async def health(request: Request) -> Response:
    """vLLM's: 200 while the engine serves, 503 once it is shut down or dead."""
    try:
        await _state(request).llm.check_health()
    except EngineDeadError as exc:
        raise api_error_for(exc) from exc
    return Response(status_code=200)


@router.get("/version", responses=ERROR_RESPONSES)
async def version() -> VersionResponse:
    return VersionResponse(version=pagedllm_version())


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    root = state.llm.config.model or str(bundled_model_path())
    max_model_len = state.llm.max_model_len
    adapters = state.adapters.all()
    return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_model_len) for name in state.model_names]
                     + [ModelCard(id=adapter.lora_name, root=adapter.lora_path, parent=state.adapters.parent_of(adapter),
                                  max_model_len=max_model_len) for adapter in adapters])


@router.post("/v1/completions", responses=generation_responses(CompletionResponse, CompletionResponse))
async def completions(body: CompletionRequest, request: Request):
    return await create_completion(body, request, _state(request))


@router.post("/v1/chat/completions", responses=generation_responses(ChatCompletionResponse, ChatCompletionChunk))
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await create_chat_completion(body, request, _state(request))


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> TokenizeResponse:
    """vLLM's: token ids of a prompt, or of a conversation through the chat template."""
    check_undeclared_fields(body)
    state = _state(request)
    state.resolve_model(body.model)   # an adapter shares the base model's tokenizer
    if isinstance(body, TokenizeChatRequest):
        tokens = state.chat_prompt_ids(body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs)
    else:
        tokens = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return TokenizeResponse(count=len(tokens), max_model_len=state.llm.max_model_len, tokens=tokens)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    check_undeclared_fields(body)
    state = _state(request)
    state.resolve_model(body.model)
    vocab_size = state.llm.model_config.vocab_size
    if not all(0 <= token < vocab_size for token in body.tokens):
        raise APIError(400, f"tokens must be integers in [0, {vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))


@router.get("/metrics", responses={200: {"description": "Prometheus' text format",
                                         "content": {"text/plain": {"schema": {"type": "string"}}}},
                                    **ERROR_RESPONSES})
async def metrics(request: Request) -> Response:
    state = _state(request)
    body = state.metrics.exposition(await state.engine_stats())
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(llm: EngineClient, config: ServerConfig) -> FastAPI:
    """The app over an engine client that is already loaded; its lifespan shuts the engine down."""
    model_names = config.served_model_name or [llm.config.model or bundled_model_path().stem]
    api_keys: dict[str, str | None] = {**config.tenant_keys, **({config.api_key: None} if config.api_key else {})}
    state = ServerState(llm=llm, model_names=model_names, metrics=ServerMetrics(model_names[0]),
                        system_fingerprint=f"pagedllm-{pagedllm_version()}", salt_by_tenant=bool(config.tenant_keys),
                        chat_template=config.chat_template_text, tool_call_parser=config.tool_call_parser,
                        enable_auto_tool_choice=config.enable_auto_tool_choice,
                        reasoning_parser=config.reasoning_parser,
                        adapters=ServedAdapters(llm, model_names))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            if llm.config.enable_lora:
                await _load_lora_modules(state.adapters, config.lora_modules or [])
            stats_task = asyncio.create_task(log_stats_periodically(state))
            try:
                yield
            finally:
                # uvicorn gets here after in-flight requests finished or were cancelled (aborting them).
                stats_task.cancel()
        finally:
            await llm.shutdown()

    app = FastAPI(title="pagedllm", version=pagedllm_version(), lifespan=lifespan)
    app.state.server = state
    app.state.response_store = ResponseStore(config.responses_store_size, config.responses_store_ttl)
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(pooling_router)
    if config.allow_runtime_lora_updating:
        logger.warning("runtime LoRA updating is on (--allow-runtime-lora-updating or %s): clients with the API key "
                       "can load adapters from any path this server can read", RUNTIME_LORA_UPDATING_ENV)
        app.include_router(runtime_updates_router)
    local_engine = llm.local_engine()
    if not config.disable_dashboard and local_engine is not None:   # Ray replicas keep their engines elsewhere
        install_dashboard(app, local_engine, api_key_required=bool(api_keys))
    # The last added runs first: the key is checked before the body is even counted.
    app.add_middleware(RequestSizeLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, keys=api_keys)
    return app


async def _load_lora_modules(adapters: ServedAdapters, modules: list[LoRAModulePath]) -> None:
    """--lora-modules, loaded before the server answers; one that fails stops the server, with the reason."""
    for module in modules:
        try:
            await adapters.load(module.name, module.path, module.base_model_name)
        except APIError as exc:
            raise RuntimeError(f"--lora-modules {module.name}={module.path}: {exc.message}") from exc
    served = ", ".join(f"{adapter.lora_name} (id {adapter.lora_int_id}, {adapter.lora_path})"
                       for adapter in adapters.all())
    logger.info("LoRA adapters: %s", served or "none yet")


def _exit_cleanly(signum: int, frame) -> None:
    sys.exit(0)


def start_engine(engine_config: EngineConfig, max_waiting_requests: int | None) -> EngineClient:
    """One engine in this process, or (distributed_executor_backend ray) its replicas on Ray; loads the model."""
    if engine_config.distributed_executor_backend == "ray":
        return DPAsyncLLM.from_config(engine_config, max_waiting_requests)
    return AsyncLLM.from_config(engine_config, max_waiting_requests)


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    """Loads the model, then serves until SIGINT/SIGTERM: uvicorn stops accepting connections, gives
    in-flight requests shutdown_timeout seconds, cancels the rest, and the lifespan stops the engine."""
    llm = start_engine(engine_config, config.max_waiting_requests)
    serve_app(build_app(llm, config), llm, config)


def serve_app(app: FastAPI, llm: EngineClient, config: ServerConfig) -> None:
    """Serves a built app until SIGINT/SIGTERM (run_server's second half, for launchers that build their own)."""
    logger.info("serving %s %s at http://%s:%d", app.state.server.model_name, llm.describe(), config.host,
                config.port)
    # uvicorn re-raises the signal that stopped it once its graceful shutdown is over; by then
    # everything is done, so the process exits 0 instead of dying by the signal.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_cleanly)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                           timeout_graceful_shutdown=config.shutdown_timeout))
    server.run()
