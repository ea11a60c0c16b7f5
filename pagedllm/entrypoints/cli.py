"""The `pagedllm` command line: serve, generate, chat and bench.

Engine and server flags map one to one onto EngineConfig and ServerConfig fields. Their
argparse defaults are suppressed so that a flag absent from the command line cannot mask
the same key in a `--config` file; the dataclasses' own defaults fill whatever is left.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import logging
import sys

from pagedllm.config import (ACTIVATION_DTYPES, ATTENTION_BACKENDS, DATA_PARALLEL_ROUTINGS,
                             DISTRIBUTED_EXECUTOR_BACKENDS, DTYPES, KV_CACHE_DTYPES, LORA_DTYPES, MAX_LORA_RANKS,
                             POOLING_CHOICES, PREEMPTION_MODES, QUANTIZATIONS, RUNNERS, SCHEDULING_POLICIES,
                             EngineConfig)
from pagedllm.entrypoints.config_file import merge_config
from pagedllm.entrypoints.openai.lora_modules import lora_module
from pagedllm.entrypoints.openai.server_config import (REASONING_PARSER_NAMES, RUNTIME_LORA_UPDATING_ENV,
                                                       TOOL_PARSER_NAMES, ServerConfig)

_UNSET = argparse.SUPPRESS

# `pagedllm bench NAME`: the module that runs it (add_arguments, run) and its line of help.
BENCHMARKS = {
    "throughput": ("pagedllm.bench.throughput", "offline throughput on a workload, optionally against transformers"),
    "latency": ("pagedllm.bench.latency", "prefill and per-token decode time of one batch"),
    "serving": ("pagedllm.bench.serving", "TTFT / TPOT / ITL / latency against a running server"),
    "memory": ("pagedllm.bench.memory", "KV utilisation, sharing and concurrency figures"),
    "dashboard": ("pagedllm.bench.dashboard_cost", "server throughput with the live KV-cache page open against closed"),
    "sweep": ("pagedllm.bench.sweep", "throughput and KV waste by block size, with a plot"),
    "scheduling": ("pagedllm.bench.scheduling", "scheduler + KV bookkeeping time per step"),
    "structured": ("pagedllm.bench.structured_outputs",
                   "decode step time with structured outputs against without, at batch 64"),
    "accuracy": ("pagedllm.bench.accuracy", "bfloat16 against float32 greedy tokens, or KV cache dtypes teacher-forced"),
    "kernels": ("pagedllm.bench.kernels", "quantized linear kernels against the float matmul, per row count; "
                                         "--attention: the prefill attention paths per prompt length"),
    "cascade": ("pagedllm.bench.cascade",
                "the shared-prefix attention kernel against the plain decode kernel, per group size"),
    "load": ("pagedllm.bench.load", "peak RSS, weight bytes and time of loading a model, against the streaming-load bound"),
    "embed": ("pagedllm.bench.embed", "embedding inputs/s and tokens/s against sentence-transformers, side by side"),
    "logit-controls": ("pagedllm.bench.logit_controls",
                       "cost of logit_bias / allowed_token_ids / bad_words and prompt_logprobs"),
    "multi-turn": ("pagedllm.bench.multi_turn", "multi-turn conversations over a small RAM pool, KV disk tier off and on"),
}


def _default(settings: type, name: str) -> str:
    return f"(default: {getattr(settings, name)})"


def json_mapping(text: str) -> dict:
    """A JSON object flag value, such as --speculative-config '{"method": "ngram", ...}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def cascade_setting(text: str) -> bool | None:
    """--enable-cascade-attention's value: auto (None), on (True) or off (False)."""
    values = {"auto": None, "on": True, "true": True, "off": False, "false": False}
    if text.lower() not in values:
        raise argparse.ArgumentTypeError(f"expected auto, on or off, got {text!r}")
    return values[text.lower()]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig flags, shared by every command that loads a model."""
    parser.add_argument("model", nargs="?", default=_UNSET,
                        help="model folder, GGUF file or cached Hugging Face name (default: bundled SmolLM2)")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML file with the same keys as these flags (block_size or block-size, "
                             "optionally under engine_args:); flags on the command line override it")
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", choices=DTYPES, default=_UNSET,
                       help=f"precision of activations and float weights {_default(EngineConfig, 'dtype')}")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default=_UNSET,
                       help="auto keeps a GGUF's quantized weights quantized and float checkpoints float; none "
                            "dequantizes; int8/int4 quantize float weights at load "
                            f"{_default(EngineConfig, 'quantization')}")
    group.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES, default=_UNSET,
                       help="what quantized layers multiply: model, --dtype's activations against the weights "
                            "dequantized on the fly; int16, activations quantized to int16 per row and "
                            "32 columns (as accurate; twice float32's rate on AVX2 and AVX-512 VNNI); auto, int16 on "
                            "CPUs with AVX2 and without AVX-512, or AVX-512 VNNI without BF16, model elsewhere; int8, "
                            "activations quantized to int8 (less accurate, faster at few rows: docs/quantization.md) "
                            f"{_default(EngineConfig, 'activation_dtype')}")
    group.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=_UNSET,
                       help="a request's results bitwise independent of the batch it shares (quantized weights: "
                            f"one matmul kernel for every row count) {_default(EngineConfig, 'batch_invariant')}")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=_UNSET,
                       help="precision of the KV cache: auto is --dtype's (bfloat16 where dtype auto chose "
                            "float32 on a CPU without fast bfloat16); int8 keeps a scale per token and kv head "
                            f"{_default(EngineConfig, 'kv_cache_dtype')}")
    group.add_argument("--device", default=_UNSET, help="cpu or cuda (default: cuda when present)")
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=_UNSET,
                       help="attention kernels: cpu (C++), triton (CUDA; on CPU only under TRITON_INTERPRET=1), torch "
                            "(the PyTorch reference); auto is PAGEDLLM_ATTENTION_BACKEND if set, else triton on CUDA "
                            f"and cpu on CPU {_default(EngineConfig, 'attention_backend')}")
    group.add_argument("--block-size", type=int, default=_UNSET,
                       help=f"tokens per KV block, a power of two from 8 to 256 {_default(EngineConfig, 'block_size')}")
    group.add_argument("--max-num-seqs", type=int, default=_UNSET,
                       help=f"most sequences in one batch {_default(EngineConfig, 'max_num_seqs')}")
    group.add_argument("--max-num-batched-tokens", type=int, default=_UNSET,
                       help="most tokens in one step (default: 2048, or max-model-len without chunked prefill)")
    group.add_argument("--max-model-len", type=int, default=_UNSET,
                       help="longest prompt + output in tokens (default: the model's context length)")
    group.add_argument("--kv-cache-memory", default=_UNSET,
                       help="KV-cache size in bytes or as 4GiB, 512MB... (default: 4GiB on CPU; "
                            "on CUDA, from --gpu-memory-utilization)")
    group.add_argument("--gpu-memory-utilization", type=float, default=_UNSET,
                       help="fraction of GPU memory the engine may take, on CUDA when --kv-cache-memory is not "
                            f"given {_default(EngineConfig, 'gpu_memory_utilization')}")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=_UNSET,
                       help=f"reuse the KV blocks of shared prompt prefixes "
                            f"{_default(EngineConfig, 'enable_prefix_caching')}")
    group.add_argument("--max-pinned-kv-cache-fraction", type=float, default=_UNSET,
                       help="most of the KV pool that prompt-cache pins (the Messages API's cache_control) may hold; a "
                            "pin past it is shortened to what fits "
                            f"{_default(EngineConfig, 'max_pinned_kv_cache_fraction')}")
    group.add_argument("--kv-cache-dir", default=_UNSET,
                       help="keep prefix-cache blocks evicted from RAM as files in this directory (made 0700 if "
                            "absent; refused if made for another model), read back on a hit and after a restart "
                            "(default: off)")
    group.add_argument("--kv-cache-disk-bytes", default=_UNSET,
                       help="most bytes of block files in --kv-cache-dir, as 64GiB, 500MB...; the least recently "
                            f"used go first {_default(EngineConfig, 'kv_cache_disk_bytes')}")
    group.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=_UNSET,
                       help="what a preempted request does with its KV: recompute it later, swap it out (to "
                            "--kv-cache-dir if set, else to --swap-space of RAM) and back, or auto: the cheaper by "
                            f"measured cost {_default(EngineConfig, 'preemption_mode')}")
    group.add_argument("--swap-space", type=float, default=_UNSET,
                       help="GiB of RAM for swapped-out KV blocks when --kv-cache-dir is not set "
                            f"{_default(EngineConfig, 'swap_space')}")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=_UNSET,
                       help=f"split long prompts across steps {_default(EngineConfig, 'enable_chunked_prefill')}")
    group.add_argument("--enable-cascade-attention", nargs="?", const=True, type=cascade_setting, default=_UNSET,
                       metavar="{auto,on,off}",
                       help="sequences that share leading KV blocks (parallel samples, beams, prefix-cache hits) "
                            "read them once per step; CPU kernels only. auto: for the groups where the kernels, timed "
                            "at start-up on this CPU, say it pays; on (the flag alone): every group; off: never "
                            "(default: auto)")
    group.add_argument("--no-enable-cascade-attention", dest="enable_cascade_attention", action="store_const",
                       const=False, default=_UNSET, help="the same as --enable-cascade-attention off")
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=_UNSET,
                       help=f"order of the waiting queue {_default(EngineConfig, 'scheduling_policy')}")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=_UNSET,
                       help="processes splitting each layer (gloo on CPU, NCCL on CUDA); --kv-cache-memory is "
                            f"per process {_default(EngineConfig, 'tensor_parallel_size')}")
    group.add_argument("--seed", type=int, default=_UNSET,
                       help=f"seed of the sampler's random generator {_default(EngineConfig, 'seed')}")
    group.add_argument("--data-parallel-size", type=int, default=_UNSET,
                       help="engine replicas, each with the whole model and its own KV cache, as Ray actors "
                            f"{_default(EngineConfig, 'data_parallel_size')}")
    group.add_argument("--data-parallel-routing", choices=DATA_PARALLEL_ROUTINGS, default=_UNSET,
                       help="prefix: a request goes to the replica holding the longest cached prefix of its prompt "
                            "(within --data-parallel-balance-abs-threshold), else the least loaded; least-loaded: "
                            "by requests in flight only (default: prefix with several replicas and prefix caching)")
    group.add_argument("--data-parallel-balance-abs-threshold", type=int, default=_UNSET,
                       help="a replica gets requests for its cached prefixes only while its requests in flight exceed "
                            "the least loaded replica's by at most this many "
                            f"{_default(EngineConfig, 'data_parallel_balance_abs_threshold')}")
    group.add_argument("--distributed-executor-backend", choices=DISTRIBUTED_EXECUTOR_BACKENDS, default=_UNSET,
                       help="ray: the engine replicas are Ray actors (joining a cluster started with `ray start`, "
                            "or a local one); mp: one engine in this process "
                            "(default: ray when --data-parallel-size > 1, else mp)")
    group.add_argument("--speculative-config", type=json_mapping, default=_UNSET, metavar="JSON",
                       help='speculative decoding, vLLM\'s shape: \'{"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' or \'{"method": "draft_model", '
                            '"model": PATH, "num_speculative_tokens": 4}\'; optional "disable_by_batch_size": N (default auto: 4 '
                            'for ngram, 2 for a draft model; null: never), and '
                            'for a draft model "quantization" (default: off)')
    group.add_argument("--runner", choices=RUNNERS, default=_UNSET,
                       help="generate text or pool (embeddings, scores); auto: pooling for encoder, bare-model and "
                            "sequence-classification checkpoints and sentence-transformers folders (default: auto)")
    group.add_argument("--pooling", choices=POOLING_CHOICES, default=_UNSET,
                       help="a pooling model's pooling, short for --pooler-config '{\"pooling_type\": ...}' "
                            "(default: the checkpoint's sentence-transformers config, else the architecture's)")
    group.add_argument("--pooler-config", "--override-pooler-config", type=json_mapping, default=_UNSET,
                       metavar="JSON", help='vLLM\'s: \'{"pooling_type": "MEAN", "normalize": true}\' '
                                            "(default: from the checkpoint)")
    group.add_argument("--hf-overrides", type=json_mapping, default=_UNSET, metavar="JSON",
                       help='config.json keys to replace, e.g. \'{"is_matryoshka": true}\' (default: none)')
    group.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=_UNSET,
                       help=f"serve LoRA adapters (PEFT folders) over the base model {_default(EngineConfig, 'enable_lora')}")
    group.add_argument("--max-loras", type=int, default=_UNSET,
                       help=f"most adapters in one step {_default(EngineConfig, 'max_loras')}")
    group.add_argument("--max-lora-rank", type=int, choices=MAX_LORA_RANKS, default=_UNSET,
                       help=f"largest adapter rank that loads {_default(EngineConfig, 'max_lora_rank')}")
    group.add_argument("--max-cpu-loras", type=int, default=_UNSET,
                       help="adapters kept loaded in memory, least recently used dropped first (default: --max-loras)")
    group.add_argument("--lora-dtype", choices=LORA_DTYPES, default=_UNSET,
                       help="dtype of the adapters' weights; auto is the model's (bfloat16 where dtype auto "
                            f"chose float32 on a CPU without fast bfloat16) {_default(EngineConfig, 'lora_dtype')}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The ServerConfig flags of `pagedllm serve`."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=_UNSET, help=f"address to listen on {_default(ServerConfig, 'host')}")
    group.add_argument("--port", type=int, default=_UNSET, help=f"port to listen on {_default(ServerConfig, 'port')}")
    group.add_argument("--served-model-name", nargs="+", default=_UNSET, metavar="NAME",
                       help="model name(s) the API accepts; the first is reported (default: the model argument, "
                            "or the bundled model's name)")
    group.add_argument("--api-key", default=_UNSET,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: none)")
    group.add_argument("--api-keys-file", default=_UNSET, metavar="FILE",
                       help="YAML mapping of API key to tenant name, accepted beside --api-key; each tenant's "
                            "requests are salted so tenants never share prefix-cache blocks (default: none)")
    group.add_argument("--max-waiting-requests", type=int, default=_UNSET,
                       help="most requests queued for the engine; past it new ones get 503 with Retry-After "
                            "(default: no bound)")
    group.add_argument("--max-request-body-bytes", type=int, default=_UNSET,
                       help=f"larger request bodies get 413 {_default(ServerConfig, 'max_request_body_bytes')}")
    group.add_argument("--shutdown-timeout", type=float, default=_UNSET,
                       help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted "
                            f"{_default(ServerConfig, 'shutdown_timeout')}")
    group.add_argument("--disable-dashboard", action="store_true", default=_UNSET,
                       help="serve no /dashboard page and no /v1/kv_map routes (default: served)")
    group.add_argument("--chat-template", default=_UNSET, metavar="FILE",
                       help="a Jinja chat template used instead of the model's own (default: the model's)")
    group.add_argument("--tool-call-parser", choices=TOOL_PARSER_NAMES, default=_UNSET,
                       help="how tool calls are read from the model's text with tool_choice auto (default: none)")
    group.add_argument("--enable-auto-tool-choice", action="store_true", default=_UNSET,
                       help="allow tool_choice auto (needs --tool-call-parser; required and named choices "
                            "work without it) (default: off)")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=_UNSET,
                       help="split the model's reasoning into reasoning_content: qwen3 reads <think>...</think> "
                            "(default: none)")
    group.add_argument("--responses-store-size", type=int, default=_UNSET,
                       help="stored responses (/v1/responses with store true) kept in memory; past it the oldest "
                            f"go {_default(ServerConfig, 'responses_store_size')}")
    group.add_argument("--responses-store-ttl", type=float, default=_UNSET, metavar="SECONDS",
                       help=f"how long a stored response is kept {_default(ServerConfig, 'responses_store_ttl')}")
    group.add_argument("--lora-modules", nargs="+", type=_lora_module_flag, default=_UNSET, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) served from start-up, each a model name of its own: "
                            "name=path or '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' "
                            "(needs --enable-lora) (default: none)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true", default=_UNSET,
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; "
                            f"as {RUNTIME_LORA_UPDATING_ENV}=True does) (default: off)")


def _lora_module_flag(text: str):
    try:
        return lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve_settings(args: argparse.Namespace, settings: dict[str, type]) -> dict[str, object]:
    """{name: instance} of each settings dataclass, from the --config file and the flags given."""
    known = set().union(*(cls.field_names() for cls in settings.values()))
    given = {key: value for key, value in vars(args).items() if key in known}
    values = merge_config(args.config, given, known)
    return {name: cls(**{key: value for key, value in values.items() if key in cls.field_names()})
            for name, cls in settings.items()}


def _generate(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(args.engine_config))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def _chat(args: argparse.Namespace) -> None:
    """Reads user turns from stdin and streams each answer as the engine makes it."""
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import RequestOutputKind, SamplingParams

    engine = LLMEngine(args.engine_config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            output_kind=RequestOutputKind.DELTA)
    conversation = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    print("Type a message and press Enter; /exit or Ctrl-D ends the chat.", file=sys.stderr)
    try:
        _chat_turns(engine, params, conversation)
    except KeyboardInterrupt:   # Ctrl-C, even mid-answer, ends the chat without a traceback
        print(file=sys.stderr)


def _chat_turns(engine, params, conversation: list[dict]) -> None:
    for turn in itertools.count():
        try:
            line = input("> ").strip()
        except EOFError:
            return
        if line == "/exit":
            return
        if not line:
            continue
        conversation.append({"role": "user", "content": line})
        prompt = {"prompt_token_ids": engine.tokenizer.apply_chat_template(conversation)}
        try:
            engine.add_request(str(turn), prompt, params)
        except ValueError as exc:   # the conversation outgrew max_model_len, for one
            conversation.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        reply = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.error is not None:
                    print(f"\nerror: {output.error}", file=sys.stderr)
                reply.append(output.outputs[0].text)
                print(reply[-1], end="", flush=True)
        print()
        conversation.append({"role": "assistant", "content": "".join(reply)})


def _serve(args: argparse.Namespace) -> None:
    from pagedllm.entrypoints.api_server import run_server

    run_server(args.engine_config, args.server_config)


def build_parser(benchmark: str | None = None) -> argparse.ArgumentParser:
    """The command line; `benchmark` names the `pagedllm bench` subcommand whose module and arguments to load."""
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                description="Serve a model over an OpenAI-compatible HTTP API "
                                            "(/v1/completions, /v1/chat/completions, /v1/models, /metrics...).")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(handler=_serve, settings={"engine_config": EngineConfig, "server_config": ServerConfig})

    generate = commands.add_parser("generate", help="generate a completion for one prompt and print it")
    generate.add_argument("prompt")
    add_engine_args(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                          help="wrap the prompt in the model's chat template (default: on)")
    generate.set_defaults(handler=_generate, settings={"engine_config": EngineConfig})

    chat = commands.add_parser("chat", help="chat with the model in the terminal",
                               description="Interactive chat: type a message and press Enter; the answer "
                                           "streams back and the conversation is kept. /exit or EOF ends it.")
    add_engine_args(chat)
    chat.add_argument("--system-prompt", default=None, help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=512, help="longest answer in tokens (default: 512)")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    chat.set_defaults(handler=_chat, settings={"engine_config": EngineConfig})

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    for name, (module_name, text) in BENCHMARKS.items():
        # Only the chosen benchmark's module is imported, for its arguments; the others stay a name and a line.
        sub = bench.add_parser(name, help=text, add_help=name == benchmark)
        if name == benchmark:
            module = importlib.import_module(module_name)
            sub.description = module.__doc__
            module.add_arguments(sub)
            sub.set_defaults(handler=module.run, settings={})
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line; for model commands also builds args.engine_config (and, for serve,
    args.server_config) from the --config file and the flags. Bad settings exit with a usage error.
    A first pass finds which benchmark `pagedllm bench NAME` names, so that only its module is loaded."""
    chosen, _ = build_parser().parse_known_args(argv)
    parser = build_parser(getattr(chosen, "benchmark", None))
    args = parser.parse_args(argv)
    if args.settings:
        try:
            resolved = resolve_settings(args, args.settings)
            if "server_config" in resolved:
                resolved["server_config"].check_engine(resolved["engine_config"])
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        vars(args).update(resolved)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.handler(args)


if __name__ == "__main__":
    main()
