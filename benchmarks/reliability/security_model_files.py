"""Security checks on what a model folder can make the server do: a hostile chat template renders in a
sandbox (a 400, nothing run), and code shipped in the folder (auto_map, a custom tokenizer) is never imported."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import torch

from benchmarks.reliability.security_check import ERROR_FIELDS, require
from pagedllm.bench.server_process import ServerProcess

# Chat-template attacks, chosen by the user message's content. SENTINEL is replaced by a file path:
# the file exists only if an attack ran a shell command.
RAISING_ATTACKS = {
    "mro-subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "cycler-globals-os-system": "{{ cycler.__init__.__globals__.os.system('touch SENTINEL') }}",
    "lipsum-globals-popen": "{{ lipsum.__globals__['os'].popen('touch SENTINEL').read() }}",
    "self-builtins-import": "{{ self.__init__.__globals__.__builtins__.__import__('os').system('touch SENTINEL') }}",
    "format-string-attributes": "{{ '{0.__class__.__mro__}'.format('') }}",
    "attr-filter": "{{ (''|attr('__class__')).__mro__ }}",
    "subscript-dunder": "{{ ''['__class__']['__mro__'] }}",
    "namespace-dunder": "{% set ns = namespace() %}{% set ns.__class__ = none %}",
    "mutate-messages": "{{ messages.append(messages) }}",
}
# A lone unsafe attribute is jinja's "undefined": it renders as nothing, and fails on any use (above).
SILENT_ATTACKS = {
    "function-globals": "[{{ raise_exception.__globals__ }}]",
    "format-map-attributes": "[{{ '{x.__class__}'.format_map({'x': ''}) }}]",
}
_PLAIN_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Imported, it leaves proof behind.
_EVIL_MODULE = "import pathlib\npathlib.Path({sentinel!r}).touch()\n"


def hostile_chat_template(sentinel: Path) -> str:
    """One template holding every attack, chosen by the last message's content; any other content
    gets a plain ChatML rendering, so the same server shows it still answers."""
    attacks = {name: body.replace("SENTINEL", str(sentinel))
               for name, body in {**RAISING_ATTACKS, **SILENT_ATTACKS}.items()}
    branches = "".join(f"{{% {'elif' if index else 'if'} attack == {name!r} %}}{body}"
                       for index, (name, body) in enumerate(attacks.items()))
    return f"{{% set attack = messages[-1]['content'] %}}{branches}{{% else %}}{_PLAIN_CHATML}{{% endif %}}"


def write_hostile_chat_template(model_dir: Path, sentinel: Path) -> None:
    """Into tokenizer_config.json, where most Hub models keep theirs (a chat_template.jinja would win)."""
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = hostile_chat_template(sentinel)
    config_path.write_text(json.dumps(config, indent=2))


def chat_templates_sandboxed(server: ServerProcess, sentinel: Path) -> str:
    """Raising attacks get an OpenAI 400 (chat and /tokenize), silent ones render nothing, no command
    runs, a client cannot send its own template, and the server still answers a plain chat."""
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as client:
        for attack in RAISING_ATTACKS:
            messages = [{"role": "user", "content": attack}]
            for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}),
                               ("/tokenize", {"messages": messages})):
                response = client.post(path, json=body)
                error = response.json().get("error", {}) if response.status_code == 400 else {}
                require(set(error) == ERROR_FIELDS and error["type"] == "invalid_request_error",
                        f"attack {attack!r} on {path}: {response.status_code} {response.text[:200]}")
        for attack in SILENT_ATTACKS:
            rendered = rendered_chat(client, [{"role": "user", "content": attack}])
            require(rendered == "[]", f"attack {attack!r} rendered {rendered[:200]!r}, expected '[]'")
        require(not sentinel.exists(), f"a template attack ran a command: {sentinel} exists")
        plain = [{"role": "user", "content": "hello"}]
        injected = client.post("/tokenize", json={"messages": plain, "chat_template": "INJECTED"}).json()
        require(injected["tokens"] == client.post("/tokenize", json={"messages": plain}).json()["tokens"],
                "a chat_template sent by the client changed the rendering")
        answer = client.post("/v1/chat/completions", json={"messages": plain, "max_tokens": 2})
        require(answer.status_code == 200, f"a plain chat after the attacks: {answer.status_code} {answer.text[:200]}")
    return (f"{len(RAISING_ATTACKS)} attacks refused with 400, {len(SILENT_ATTACKS)} rendered empty, "
            "nothing ran, the server still answers")


def rendered_chat(client: httpx.Client, messages: list[dict]) -> str:
    """The server's rendering of a conversation, read back through /tokenize and /detokenize."""
    tokens = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})
    require(tokens.status_code == 200, f"/tokenize: {tokens.status_code} {tokens.text[:200]}")
    return client.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]


def tiny_model_dir(folder: Path) -> Path:
    """A seeded two-layer Llama with random weights and the bundled tokenizer: a real model folder,
    made in seconds, whose files the checks can then tamper with."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedllm.model.loader import bundled_model_path
    from pagedllm.tokenizer import load_tokenizer_from_gguf

    tokenizer = load_tokenizer_from_gguf(bundled_model_path()).hf
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def with_remote_model_code(model_dir: Path, sentinel: Path, architecture: str) -> Path:
    """config.json points auto_map at modeling_evil.py, which touches sentinel when imported."""
    (model_dir / "modeling_evil.py").write_text(_EVIL_MODULE.format(sentinel=str(sentinel)))
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [architecture]
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def with_remote_tokenizer_code(model_dir: Path, sentinel: Path) -> Path:
    """tokenizer_config.json names a tokenizer class that only tokenization_evil.py defines."""
    (model_dir / "tokenization_evil.py").write_text(_EVIL_MODULE.format(sentinel=str(sentinel)))
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "EvilTokenizer"
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", "tokenization_evil.EvilTokenizer"]}
    config_path.write_text(json.dumps(config, indent=2))
    return model_dir


def load_error(model_dir: Path) -> str | None:
    """Why loading the folder failed, or None if it loaded."""
    from pagedllm.model.loader import load_checkpoint

    try:
        load_checkpoint(str(model_dir))
    except (ValueError, OSError) as exc:
        return str(exc)
    return None


def no_remote_code(model_dir: Path, workdir: Path) -> str:
    """Model code in an unsupported architecture's auto_map is refused, a supported architecture loads
    without its auto_map, custom tokenizer code is refused, and none of the shipped code is imported."""
    sentinel = workdir / "remote-code-ran"

    def variant(name: str) -> Path:
        return shutil.copytree(model_dir, workdir / name, dirs_exist_ok=True)

    unsupported = load_error(with_remote_model_code(variant("unsupported"), sentinel, "EvilForCausalLM"))
    require(unsupported is not None and "auto_map" in unsupported,
            f"a model whose code ships in its folder: {unsupported or 'it loaded'}")
    supported = load_error(with_remote_model_code(variant("supported"), sentinel, "LlamaForCausalLM"))
    require(supported is None, f"a Llama with an auto_map did not load: {supported}")
    tokenizer = load_error(with_remote_tokenizer_code(variant("tokenizer"), sentinel))
    require(tokenizer is not None and "custom code" in tokenizer,
            f"a tokenizer whose code ships in its folder: {tokenizer or 'it loaded'}")
    require(not sentinel.exists(), "code shipped in a model folder was imported")
    return "shipped model and tokenizer code is refused, never imported"
