"""Multi-LoRA serving through `pagedllm serve` on loopback, driven by the official openai client and raw httpx:
adapters from --lora-modules and loaded at run time are models of their own, answer as the offline engine does
with the same adapter (and unlike the base), unload only when nothing runs them, and show in /metrics.

The base is a tiny random Llama with the bundled tokenizer's whole vocabulary (so text prompts work); the
adapters are random ones made by peft. The server runs under the fault-injection launcher, whose hold keeps a
request running part-way through its prefill for as long as a scenario needs (no sleeps, no timing).
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER, HOLD_FAULT, RELEASE_ROUTE
from benchmarks.reliability.faults import hold_counts
from pagedllm import LLM, SamplingParams
from pagedllm.bench.lora_adapters import make_random_adapters
from pagedllm.bench.server_process import ServerProcess, poll
from pagedllm.entrypoints.cli import parse_args
from pagedllm.lora.request import LoRARequest

API_KEY = "lora-key"
BASE = "tiny"
VOCAB_SIZE = 49152   # the bundled tokenizer's
CHUNK = 16           # max_num_batched_tokens: a longer prompt's prefill takes several steps, so it can be held
ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-num-batched-tokens", str(CHUNK),
                "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
LLM_SETTINGS = dict(dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=CHUNK, enable_lora=True,
                    max_loras=2, max_lora_rank=8)
TIMEOUT = 120   # seconds: a state that never comes fails the test instead of hanging it
PROMPT = "The lighthouse keeper climbed the stairs and"
MESSAGES = [{"role": "user", "content": "Name a colour of the sea."}]


@pytest.fixture(scope="module")
def model_dir(make_tiny_model_dir, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-server"), "llama", vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Three random rank-8 adapters: two on every linear layer, one on attention only."""
    folder = tmp_path_factory.mktemp("adapters")
    every_linear = make_random_adapters(str(model_dir), folder / "all", 2, rank=8, seed=1)
    attention = make_random_adapters(str(model_dir), folder / "attention", 1, rank=8, seed=7,
                                     target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    return [str(path) for path in every_linear + attention]


@pytest.fixture(scope="module")
def server(model_dir, adapters, tmp_path_factory):
    """--lora-modules in both of vLLM's forms; runtime updates switched on by vLLM's environment variable."""
    json_form = json.dumps({"name": "json-form", "path": adapters[1], "base_model_name": BASE})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        process = ServerProcess(tmp_path_factory.mktemp("lora-server-log") / "server.log", str(model_dir),
                                *ENGINE_FLAGS, "--served-model-name", BASE,
                                "--lora-modules", f"static={adapters[0]}", json_form,
                                api_key=API_KEY, launcher=FAULT_INJECTION_LAUNCHER)
    yield process   # conftest's client and http fixtures drive it
    process.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), **LLM_SETTINGS)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def offline_text(offline, prompt, adapter: LoRARequest | None, max_tokens: int = 8) -> str:
    return offline.generate(prompt, greedy(max_tokens), use_tqdm=False, lora_request=adapter)[0].outputs[0].text


def completion_text(client, model: str, prompt: str = PROMPT, max_tokens: int = 8) -> str:
    response = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.model == model
    return response.choices[0].text


def lora_requests_info(server) -> dict[str, str]:
    """The labels of pagedllm:lora_requests_info in one scrape."""
    for family in text_string_to_metric_families(server.metrics_text()):
        for sample in family.samples:
            if sample.name == "pagedllm:lora_requests_info":
                return sample.labels
    raise AssertionError("pagedllm:lora_requests_info is not in /metrics")


def test_models_list_the_adapters_under_their_base(server, client, adapters):
    models = client.models.list().data
    assert [model.id for model in models] == [BASE, "static", "json-form"]
    assert [model.model_extra["parent"] for model in models] == [None, BASE, BASE]
    assert [model.model_extra["root"] for model in models[1:]] == adapters[:2]
    startup = next(line for line in server.log().splitlines() if "LoRA adapters:" in line)
    assert f"static (id 1, {adapters[0]}), json-form (id 2, {adapters[1]})" in startup


def test_an_adapter_answers_as_the_offline_engine_with_it_and_unlike_the_base(client, offline, adapters, model_dir):
    static = LoRARequest("static", 1, adapters[0])
    assert completion_text(client, "static") == offline_text(offline, PROMPT, static)
    assert completion_text(client, BASE) == offline_text(offline, PROMPT, None)
    assert completion_text(client, "static") != completion_text(client, BASE)
    assert completion_text(client, "json-form") == offline_text(offline, PROMPT, LoRARequest("json-form", 2,
                                                                                             adapters[1]))
    chat_ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                                return_dict=False)
    chat = client.chat.completions.create(model="static", messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.model == "static"
    assert chat.choices[0].message.content == offline_text(offline, {"prompt_token_ids": chat_ids}, static)


def test_the_responses_and_messages_apis_pick_the_adapter_by_model(client, http):
    chat = client.chat.completions.create(model="static", messages=MESSAGES, max_tokens=8, temperature=0)
    response = client.responses.create(model="static", input=MESSAGES[0]["content"], max_output_tokens=8,
                                       temperature=0)
    assert response.model == "static" and response.output_text == chat.choices[0].message.content
    message = http.post("/v1/messages", json={"model": "static", "max_tokens": 8, "temperature": 0,
                                              "messages": MESSAGES}).json()
    assert message["model"] == "static" and message["content"][0]["text"] == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="'nowhere' does not exist"):
        client.responses.create(model="nowhere", input="hi", max_output_tokens=2)


def test_tokenize_takes_an_adapter_name_and_pooling_refuses_one(http):
    """An adapter shares the base model's tokenizer; it cannot pool, so naming it there is refused, not ignored."""
    tokens = http.post("/tokenize", json={"model": "static", "prompt": PROMPT})
    assert tokens.status_code == 200 and tokens.json() == http.post("/tokenize", json={"prompt": PROMPT}).json()
    embeddings = http.post("/v1/embeddings", json={"model": "static", "input": PROMPT})
    assert embeddings.status_code == 400
    assert embeddings.json()["error"]["message"].startswith("'static' is a LoRA adapter, which serves text generation")


def test_loading_using_and_unloading_an_adapter_at_run_time(client, http, offline, adapters):
    loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": adapters[2]})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'runtime' added successfully.")
    assert "runtime" in [model.id for model in client.models.list().data]
    # Ids are the server's, counting on from the two --lora-modules.
    assert completion_text(client, "runtime") == offline_text(offline, PROMPT, LoRARequest("runtime", 3, adapters[2]))
    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'runtime' removed successfully.")
    assert "runtime" not in [model.id for model in client.models.list().data]
    with pytest.raises(openai.NotFoundError, match="the model 'runtime' does not exist"):
        completion_text(client, "runtime")
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"})
    assert again.status_code == 404 and again.json()["error"]["message"] == \
        "The lora adapter 'runtime' cannot be found."


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "static", "lora_path": "/elsewhere"}, 400, "The lora adapter 'static' has already been loaded."),
    ({"lora_name": BASE, "lora_path": "/elsewhere"}, 400, f"'{BASE}' is a base model's name"),
    ({"lora_name": "missing", "lora_path": "/no/such/adapter"}, 400, "LoRA adapter 'missing' cannot be loaded"),
    ({"lora_name": "", "lora_path": "/x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "typo", "lora_pth": "/x"}, 400, "lora_path"),
])
def test_bad_loads_are_refused_with_the_reason(http, client, body, status, message):
    response = http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert [model.id for model in client.models.list().data] == [BASE, "static", "json-form"]


def test_a_folder_that_is_not_an_adapter_gets_400_naming_why(http, model_dir):
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "model-folder", "lora_path": str(model_dir)})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "lora_path"


@pytest.mark.parametrize("route", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_the_endpoints_need_the_api_key(server, route):
    response = httpx.post(f"{server.url}{route}", json={"lora_name": "static", "lora_path": "/x"})
    assert response.status_code == 401


def test_unloading_an_adapter_in_use_is_409_and_its_request_completes(server, client, http, offline, adapters):
    """The held request has begun its prefill with the adapter: the unload is refused, the gauge shows the
    adapter running, and once released the request ends with the answer it would have had alone."""
    prompt = f"{HOLD_FAULT} {PROMPT} " + "one more step up the tower, " * 4
    assert len(offline.get_tokenizer().encode(prompt)) > CHUNK   # its prefill takes more than one step
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(completion_text, client, "static", prompt, 6)
        counts = poll(lambda: hold_counts(server), lambda counts: counts["held"] or held.done(), TIMEOUT)
        assert counts["held"] == 1, counts
        info = lora_requests_info(server)
        assert (info["running_lora_adapters"], info["waiting_lora_adapters"], info["max_lora"]) == ("static", "", "2")
        refused = http.post("/v1/unload_lora_adapter", json={"lora_name": "static"})
        assert refused.status_code == 409, refused.text
        assert "in use" in refused.json()["error"]["message"]
        assert http.post(RELEASE_ROUTE).json()["held"] == 1
        text = held.result(TIMEOUT)
    assert hold_counts(server)["released"] == 1
    assert text == offline_text(offline, prompt, LoRARequest("static", 1, adapters[0]), max_tokens=6)
    assert "static" in [model.id for model in client.models.list().data]   # still served
    assert lora_requests_info(server)["running_lora_adapters"] == ""


def test_lora_flags_and_their_errors(capsys, tmp_path):
    args = parse_args(["serve", "--enable-lora", "--allow-runtime-lora-updating", "--lora-modules", "a=/path/a",
                       '{"name": "b", "path": "/path/b", "base_model_name": "base"}'])
    modules = args.server_config.lora_modules
    assert [(m.name, m.path, m.base_model_name) for m in modules] == [("a", "/path/a", None), ("b", "/path/b", "base")]
    assert args.server_config.allow_runtime_lora_updating
    for argv, message in (
            (["serve", "--lora-modules", "a=/path/a"], "lora_modules needs enable_lora (--enable-lora)"),
            (["serve", "--allow-runtime-lora-updating"], "allow_runtime_lora_updating"),
            (["serve", "--enable-lora", "--lora-modules", "no-path"], "expected name=path or a JSON object"),
            (["serve", "--enable-lora", "--lora-modules", '{"name": "a"}'], "a JSON entry needs name and path"),
            (["serve", "--enable-lora", "--lora-modules", '{"name": "a", "path": "/p", "rank": 8}'],
             "unknown key(s) rank"),
            (["serve", "--enable-lora", "--lora-modules", "a=/p", "a=/q"], "a is given twice")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv


def test_without_runtime_updates_the_endpoints_are_not_there(model_dir, adapters, tmp_path, monkeypatch):
    """As in vLLM, the routes exist only with runtime updates on; --lora-modules still serve."""
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    process = ServerProcess(tmp_path / "server.log", str(model_dir), *ENGINE_FLAGS, "--served-model-name", BASE,
                            "--lora-modules", f"static={adapters[0]}")
    try:
        for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert httpx.post(f"{process.url}{route}", json={"lora_name": "x", "lora_path": "/x"}).status_code == 404
        assert [model.id for model in process.openai_client().models.list().data] == [BASE, "static"]
    finally:
        process.stop()
