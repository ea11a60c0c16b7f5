"""The `pagedllm` command line."""
from __future__ import annotations

import argparse
import logging

from pagedllm.bench import memory as memory_bench
from pagedllm.bench import scheduling as scheduling_bench
from pagedllm.config import DTYPES


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, GGUF file or cached Hugging Face name (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="bytes or a size such as 4GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    names = ("model", "dtype", "device", "block_size", "max_num_seqs", "max_num_batched_tokens",
             "max_model_len", "kv_cache_memory", "gpu_memory_utilization", "seed")
    return {name: getattr(args, name) for name in names}


def _generate(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(**_engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    print(outputs[0].outputs[0].text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="generate a completion for one prompt and print it")
    generate.add_argument("prompt")
    _add_engine_args(generate)
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                          help="wrap the prompt in the model's chat template (default: on)")
    generate.set_defaults(handler=_generate)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    for name, module, text in (("memory", memory_bench, "KV utilisation, sharing and concurrency figures"),
                               ("scheduling", scheduling_bench, "scheduler + KV bookkeeping time per step")):
        sub = bench.add_parser(name, help=text, description=module.__doc__)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.handler(args)


if __name__ == "__main__":
    main()
