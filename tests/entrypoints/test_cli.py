"""The `pagedllm` command line: --config files merged under flags, serve's help, generate and the terminal chat run
end to end against the offline API."""
from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm import SamplingParams
from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import parse_args
from pagedllm.entrypoints.config_file import load_config_file, merge_config
from pagedllm.entrypoints.openai.server_config import ServerConfig

# The brief's example, as it appears in the product article.
BRIEF_YAML = """\
engine_args:
  max_num_seqs: 256
  block_size: 32
  gpu_memory_utilization: 0.9
"""
KNOWN = EngineConfig.field_names() | ServerConfig.field_names()
# The offline reference of the end-to-end runs, with their flags: float32, the exact path, so a run that
# computes a prefix anew and one that finds it cached cannot part ways on a near tie.
LLM_SETTINGS = dict(kv_cache_memory="64MiB", dtype="float32")
ENGINE_FLAGS = ("--kv-cache-memory", "64MiB", "--dtype", "float32")
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run_cli(*argv: str, stdin: str | None = None) -> str:
    """`pagedllm ARGV` in a process of its own; its standard output."""
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *argv], input=stdin,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def brief_config(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(BRIEF_YAML)
    return path


def test_config_file_is_read_and_flags_override_it(brief_config):
    assert load_config_file(brief_config, KNOWN) == {"max_num_seqs": 256, "block_size": 32,
                                                     "gpu_memory_utilization": 0.9}
    merged = merge_config(brief_config, {"block_size": 64, "port": 9000}, KNOWN)
    assert merged == {"max_num_seqs": 256, "block_size": 64, "gpu_memory_utilization": 0.9, "port": 9000}
    assert merge_config(None, {"seed": 3}, KNOWN) == {"seed": 3}


def test_both_spellings_and_top_level_keys(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("block-size: 64\nkv-cache-memory: 256MiB\nengine_args:\n  max-num-seqs: 8\nhost: 0.0.0.0\n")
    assert load_config_file(path, KNOWN) == {"block_size": 64, "kv_cache_memory": "256MiB", "max_num_seqs": 8,
                                             "host": "0.0.0.0"}


@pytest.mark.parametrize("text, message", [
    ("engine_args:\n  max_num_seq: 8\n", "unknown key 'max_num_seq'"),
    ("blok_size: 32\n", "unknown key 'blok_size'"),
    ("block_size: 32\nblock-size: 64\n", "given twice"),
    ("- block_size\n", "expected a mapping"),
    ("block_size: [32\n", "not valid YAML"),
])
def test_bad_config_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config_file(path, KNOWN)


def test_serve_builds_its_configs_from_file_and_flags(brief_config):
    args = parse_args(["serve", "--config", str(brief_config), "--block-size", "16", "--max-model-len", "512",
                       "--no-enable-prefix-caching", "--port", "9001", "--api-key", "k"])
    assert args.engine_config == EngineConfig(max_num_seqs=256, block_size=16, gpu_memory_utilization=0.9,
                                              max_model_len=512, enable_prefix_caching=False)
    assert args.server_config == ServerConfig(port=9001, api_key="k")
    from_file_only = parse_args(["serve", "some/model", "--config", str(brief_config)])
    assert from_file_only.engine_config == EngineConfig(model="some/model", max_num_seqs=256, block_size=32)


def test_bad_settings_are_usage_errors_naming_them(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("engine_args:\n  max_num_seq: 8\n")
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", "--config", str(path)])
    assert exit_info.value.code == 2 and "unknown key 'max_num_seq'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["serve", "--block-size", "24"])
    assert "block_size must be a power of two" in capsys.readouterr().err


def test_serve_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for name in (EngineConfig.field_names() | ServerConfig.field_names()) - {"model"}:
        assert f"--{name.replace('_', '-')}" in text
    assert "--config" in text and "--no-enable-prefix-caching" in text


def test_generate_and_chat_share_the_engine_flags(brief_config):
    for argv in (["generate", "Hi", "--config", str(brief_config)], ["chat", "--config", str(brief_config)]):
        args = parse_args([*argv, "--seed", "5"])
        assert args.engine_config == EngineConfig(max_num_seqs=256, block_size=32, seed=5)


def test_chat_streams_answers_and_keeps_the_conversation(llm):
    questions = ["My name is Ada.", "What is my name?"]
    out = run_cli("chat", "--temperature", "0", "--max-tokens", "12", *ENGINE_FLAGS,
                  stdin="\n".join([*questions, "/exit", "never read"]) + "\n")
    prompts = out.split("> ")
    assert prompts[0] == "" and prompts[-1] == ""   # the last prompt read /exit
    answers = [answer.removesuffix("\n") for answer in prompts[1:-1]]
    assert len(answers) == 2 and all(answers)
    # The second answer is the one the offline API gives with the first exchange in the conversation.
    history = [{"role": "user", "content": questions[0]}, {"role": "assistant", "content": answers[0]},
               {"role": "user", "content": questions[1]}]
    assert answers[1] == llm.chat(history, GREEDY, use_tqdm=False)[0].outputs[0].text


def test_chat_system_prompt_starts_the_conversation(llm):
    system, question = "You answer in French only.", "What colour is the sky?"
    out = run_cli("chat", "--system-prompt", system, "--temperature", "0", "--max-tokens", "12", *ENGINE_FLAGS,
                  stdin=f"{question}\n")
    conversation = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    expected = llm.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text
    without_system = llm.chat(conversation[1:], GREEDY, use_tqdm=False)[0].outputs[0].text
    assert expected != without_system, "the system prompt changes nothing here: the test would prove nothing"
    assert out.split("> ")[1].removesuffix("\n") == expected


@pytest.mark.parametrize("chat", [True, False])
def test_generate_prints_the_greedy_answer(llm, chat):
    prompt = "What is the capital of France?"
    out = run_cli("generate", prompt, "--max-tokens", "12", "--temperature", "0", *ENGINE_FLAGS,
                  *(() if chat else ("--no-chat",)))
    if chat:
        expected = llm.chat([{"role": "user", "content": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].text
    else:
        expected = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    assert out == expected + "\n"


def test_scheduling_policy_flag_and_its_choices(capsys):
    assert parse_args(["serve", "--scheduling-policy", "priority"]).engine_config.scheduling_policy == "priority"
    assert parse_args(["generate", "Hi"]).engine_config.scheduling_policy == "fcfs"
    with pytest.raises(SystemExit):
        parse_args(["serve", "--scheduling-policy", "lifo"])
    assert "--scheduling-policy: invalid choice: 'lifo'" in capsys.readouterr().err


def test_bench_loads_only_the_benchmark_that_runs():
    """`pagedllm bench NAME` imports NAME's module alone (for its arguments); other commands import none."""
    probe = ("import sys; from pagedllm.entrypoints.cli import parse_args; {call}; "
             "print(sorted(m for m in sys.modules if m.startswith('pagedllm.bench.')))")

    def bench_modules(call: str) -> str:
        return subprocess.run([sys.executable, "-c", probe.format(call=call)], capture_output=True, text=True,
                              check=True).stdout.strip()

    assert bench_modules("parse_args(['generate', 'Hi'])") == "[]"
    assert bench_modules("parse_args(['bench', 'scheduling', '--steps', '3'])") == (
        "['pagedllm.bench.scheduling', 'pagedllm.bench.workload']")   # workload: scheduling's own import
    assert "--steps" in subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "scheduling",
                                        "--help"], capture_output=True, text=True, check=True).stdout
