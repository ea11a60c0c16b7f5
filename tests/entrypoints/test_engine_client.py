"""The server depends on the EngineClient protocol alone: a client that is no engine at all (it answers each
prompt with its characters reversed) serves /v1/models, /v1/completions and /health through the official
openai client, and the server reports its limits and failures."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.input_processor import CheckedPrompt
from pagedllm.engine.protocol import EngineClient, EngineDeadError
from pagedllm.engine.stats import EngineStats
from pagedllm.entrypoints.api_server import build_app
from pagedllm.entrypoints.openai.server_config import ServerConfig
from pagedllm.kv.manager import KVCacheManager
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

MAX_MODEL_LEN = 64


class CharTokenizer:
    """One token per character: id = code point."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(char) for char in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, token_ids))


class ModelConfigFacts:
    vocab_size = 0x110000


class ReversingClient(EngineClient):
    """Answers a prompt with its characters in reverse order, cut at max_tokens, in one finished output."""

    def __init__(self):
        self.config = EngineConfig(model="reverser")
        self.tokenizer = CharTokenizer()
        self.model_config = ModelConfigFacts()
        self.max_model_len = MAX_MODEL_LEN
        self.pooling = None
        self.max_waiting_requests = None
        self.dead = False
        self.num_requests = 0
        self.loras: dict[int, LoRARequest] = {}   # "adapters" change nothing in a reversal: only their bookkeeping

    @property
    def num_waiting_requests(self) -> int:
        return 0

    def check_prompt(self, prompt: dict, params: SamplingParams) -> CheckedPrompt:
        token_ids = prompt["prompt_token_ids"]
        if len(token_ids) >= MAX_MODEL_LEN:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is {MAX_MODEL_LEN}")
        return CheckedPrompt(prompt.get("prompt"), token_ids, params.max_tokens or 16, None)

    def check_pooling_prompt(self, prompt, params):
        raise ValueError("this client generates text")

    async def generate(self, prompt: dict, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        if self.dead:
            raise EngineDeadError("engine shut down")
        if lora_request is not None and lora_request.lora_int_id not in self.loras:
            raise ValueError(f"lora_request: adapter {lora_request.lora_int_id} is not loaded")
        self.num_requests += 1
        token_ids = prompt["prompt_token_ids"]
        answer = token_ids[::-1][:sampling_params.max_tokens]
        finish_reason = "length" if len(answer) < len(token_ids) else "stop"
        yield RequestOutput(request_id, prompt.get("prompt"), token_ids,
                            [CompletionOutput(0, self.tokenizer.decode(answer), answer, None, None, finish_reason)],
                            finished=True)

    async def abort(self, request_id: str) -> None:
        pass

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.loras.setdefault(lora_request.lora_int_id, lora_request) is lora_request

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.pop(lora_int_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self.loras)

    async def stats(self) -> EngineStats:
        return EngineStats(KVCacheManager(4, 16).usage(), 0, 0, 0, None)

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("engine shut down")

    def local_engine(self) -> None:
        return None

    def describe(self) -> str:
        return "(dtype none) with no KV cache"

    async def shutdown(self) -> None:
        self.dead = True


def serve(client: EngineClient, check) -> None:
    """Runs check(openai_client, http_client) against the app over `client`, in process (ASGI, no socket)."""
    async def run():
        # As over a socket: an error the app answers (and re-raises to its server, to log) reaches the client as its response.
        transport = httpx.ASGITransport(app=build_app(client, ServerConfig()), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            api = openai.AsyncOpenAI(api_key="unused", base_url="http://server/v1", http_client=http, max_retries=0)
            await check(api, http)

    asyncio.run(run())


def test_any_engine_client_serves_models_and_completions():
    client = ReversingClient()

    async def check(api: openai.AsyncOpenAI, http: httpx.AsyncClient):
        models = await api.models.list()
        assert [(model.id, model.max_model_len) for model in models.data] == [("reverser", MAX_MODEL_LEN)]
        completion = await api.completions.create(model="reverser", prompt="stressed", max_tokens=16)
        assert completion.choices[0].text == "desserts"
        assert completion.choices[0].finish_reason == "stop"
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (8, 8)
        cut = await api.completions.create(model="reverser", prompt="abcdef", max_tokens=3)
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("fed", "length")
        assert (await http.get("/health")).status_code == 200

    serve(client, check)
    assert client.num_requests == 2


def test_the_clients_checks_and_health_reach_the_caller():
    client = ReversingClient()

    async def check(api: openai.AsyncOpenAI, http: httpx.AsyncClient):
        with pytest.raises(openai.BadRequestError, match="max_model_len is 64"):
            await api.completions.create(model="reverser", prompt="x" * MAX_MODEL_LEN, max_tokens=1)
        await client.shutdown()
        assert (await http.get("/health")).status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            await api.completions.create(model="reverser", prompt="late", max_tokens=1)
        assert refused.value.status_code == 503

    serve(client, check)
    assert client.num_requests == 0
