"""`pagedllm bench accuracy`: how close a cheaper run stays to float32.

By default, how often bfloat16 picks the same greedy tokens as float32: both runs take the
same prompts (from the workload) and decode greedily. Reported: the share of sequences
identical to the end, the mean length of the common prefix, and the share of positions
holding the same token.

With --quantizations, teacher-forced in the same way (below), the model with quantized weights
against the same weights dequantized (quantization=none), float32 activations: for a GGUF, auto
(its own formats); for a float checkpoint (--float-bundled: the bundled model's weights as a
float safetensors folder), int8 and int4. Each quantization runs with each --activation-dtypes value
(model: float activations against the weights; auto: the engine's choice, int16 on AVX2 and AVX-512 VNNI builds;
int16, int8: those activations), in --dtype.

With --kv-cache-dtypes, teacher-forced, per KV cache dtype against a float32 cache, the
weights float32 throughout: each of 16 chat prompts is continued by the float32 model itself
(sampled at temperature 1 with a seed: text the model finds likely, not a greedy loop), and the
whole sequence is read in one prefill over a float32 cache and over each dtype's cache. The
next-token distributions are compared at every position: top-1 agreement and mean
KL(float32 || dtype) per token, in nats. A prefill attends each position to the cache as
decoding would, so this is the error decoding sees, without one flipped token derailing the rest.
"""
from __future__ import annotations

import argparse
import statistics

from pagedllm.bench.workload import random_workload
from pagedllm.config import ACTIVATION_DTYPES, KV_CACHE_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="default: the bundled model")
    parser.add_argument("--num-prompts", type=int, default=32, help="workload prompts, with --no-chat")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="natural chat prompts (default) instead of the workload's random token ids")
    parser.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES, metavar="DTYPE",
                        help="instead: teacher-forced comparison of these KV cache dtypes with a float32 cache, "
                             f"float32 weights ({', '.join(KV_CACHE_DTYPES)})")
    parser.add_argument("--quantizations", nargs="+", choices=("auto", "int8", "int4"), metavar="QUANTIZATION",
                        help="instead: teacher-forced comparison of the model run with these quantization values "
                             "against quantization=none (its weights dequantized), float32 activations")
    parser.add_argument("--activation-dtypes", nargs="+", choices=ACTIVATION_DTYPES, default=list(ACTIVATION_DTYPES),
                        metavar="ACTIVATION_DTYPE",
                        help="with --quantizations: run each with these activation_dtype values (default: all: "
                             f"{', '.join(ACTIVATION_DTYPES)})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "auto"), default="float32",
                        help="with --quantizations: the quantized runs' dtype (the reference stays float32); auto: "
                             "the engine's choice on this CPU, with its KV cache dtype, as the default runs")
    parser.add_argument("--float-bundled", action="store_true",
                        help="with --quantizations: use a float safetensors copy of the bundled model (its GGUF "
                             "weights dequantized, written once under ~/.cache/pagedllm) as the model")
    parser.add_argument("--continuation-len", type=int, default=256,
                        help="teacher-forced comparisons: tokens sampled after each prompt (default: 256)")


PROMPTS = ["Explain why the sky is blue.", "Write a haiku about the sea.", "What is 17 times 23?",
           "List three uses of Python.", "Summarise the plot of Hamlet in two sentences.",
           "How do vaccines work?", "Translate 'good morning' into French and German.",
           "Give me a recipe for pancakes."]
# The teacher-forced comparison's 16: the greedy comparison's 8 (its README figure) and 8 more.
TEACHER_FORCED_PROMPTS = PROMPTS + [
    "Describe how a bicycle works.", "Write a short story about a lighthouse keeper.",
    "What are the causes of the French Revolution?", "Explain recursion to a ten-year-old.",
    "Compare cats and dogs as pets.", "How does a refrigerator keep food cold?",
    "Write a letter to a friend about your holiday.", "What should I pack for a week of hiking?"]


def conversations(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": prompt}] for prompt in prompts]


def run(args: argparse.Namespace) -> None:
    if args.kv_cache_dtypes:
        compare_kv_cache_dtypes(args)
    elif args.quantizations:
        compare_quantizations(args)
    else:
        compare_greedy_tokens(args)


def compare_greedy_tokens(args: argparse.Namespace) -> None:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(args.model, dtype=dtype, kv_cache_memory="1GiB")
        if args.chat:
            outputs = llm.chat(conversations(PROMPTS), params, use_tqdm=False)
        else:
            workload = random_workload(num=args.num_prompts, vocab=llm.llm_engine.model_config.vocab_size)
            outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in workload], params,
                                   use_tqdm=False)
        runs[dtype] = [o.outputs[0].token_ids for o in outputs]
        del llm
    prefixes, same_positions = [], 0
    for exact, approx in zip(runs["float32"], runs["bfloat16"]):
        common = next((i for i, (a, b) in enumerate(zip(exact, approx)) if a != b), len(exact))
        prefixes.append(common)
        same_positions += sum(a == b for a, b in zip(exact, approx))
    total = sum(len(tokens) for tokens in runs["float32"])
    print(f"{len(prefixes)} prompts, {args.max_tokens} greedy tokens each, bfloat16 against float32")
    print("| identical sequences | mean common prefix | same token at a position |")
    print("|---|---|---|")
    print(f"| {sum(p == args.max_tokens for p in prefixes) / len(prefixes):.0%} "
          f"| {statistics.fmean(prefixes):.1f} of {args.max_tokens} | {same_positions / total:.1%} |")


def sequence_logprobs(runner, token_ids: list[int], kv_caches):
    """Log-probabilities [positions, vocab] of the next token after each position of one sequence, from
    one prefill of all of it through the runner's model into kv_caches (blocks 0 onwards)."""
    import numpy as np
    import torch

    device, length = runner.device, len(token_ids)
    positions = torch.arange(length, device=device)
    meta, _, _ = runner.attention_metadata(np.arange(-(-length // runner.block_size))[None], np.zeros(1, np.int64),
                                           np.array([length]))
    with torch.inference_mode():
        logits = runner.model(torch.tensor(token_ids, device=device), positions, kv_caches, meta, positions)
    return logits.log_softmax(-1)


def compare_kv_cache_dtypes(args: argparse.Namespace) -> None:
    import torch

    from pagedllm import LLM, SamplingParams
    from pagedllm.config.resolve import resolve_kv_cache_dtype
    from pagedllm.worker.model_runner import allocate_kv_caches, kv_bytes_per_block

    llm = LLM(args.model, dtype="float32", quantization="none", kv_cache_memory="1GiB")
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.continuation_len, ignore_eos=True)
    outputs = llm.chat(conversations(TEACHER_FORCED_PROMPTS), params, use_tqdm=False)
    sequences = [output.prompt_token_ids + list(output.outputs[0].token_ids) for output in outputs]
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    num_blocks = -(-max(map(len, sequences)) // runner.block_size)
    cache_dtypes = {name: resolve_kv_cache_dtype(name, "float32", torch.float32, runner.device)
                    for name in ("float32", *args.kv_cache_dtypes)}
    caches = {name: allocate_kv_caches(engine.model_config, num_blocks, runner.block_size, dtype, runner.device)
              for name, dtype in cache_dtypes.items()}
    agreeing = dict.fromkeys(args.kv_cache_dtypes, 0)
    divergence = dict.fromkeys(args.kv_cache_dtypes, 0.0)
    for sequence in sequences:
        reference = sequence_logprobs(runner, sequence, caches["float32"])
        for name in args.kv_cache_dtypes:
            candidate = sequence_logprobs(runner, sequence, caches[name])
            agreeing[name] += int((candidate.argmax(-1) == reference.argmax(-1)).sum())
            divergence[name] += float((reference.exp() * (reference - candidate)).sum())
    positions = sum(map(len, sequences))
    print(f"{len(sequences)} chat prompts, each continued by {args.continuation_len} tokens the float32 model "
          f"sampled ({positions} positions, {min(map(len, sequences))}-{max(map(len, sequences))} tokens a "
          f"sequence); float32 weights, each KV cache dtype against a float32 cache")
    print("| kv_cache_dtype | KV bytes per token | top-1 agreement | mean KL per token (nats) |")
    print("|---|---|---|---|")
    for name in args.kv_cache_dtypes:
        per_token = kv_bytes_per_block(engine.model_config, 1, cache_dtypes[name])
        print(f"| {name} | {per_token} | {agreeing[name] / positions:.2%} | {divergence[name] / positions:.2e} |")


def teacher_sequences(llm, continuation_len: int) -> list[list[int]]:
    """The 16 chat prompts, each continued by `llm` itself (sampled at temperature 1, seeded)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=1.0, seed=0, max_tokens=continuation_len, ignore_eos=True)
    outputs = llm.chat(conversations(TEACHER_FORCED_PROMPTS), params, use_tqdm=False)
    return [output.prompt_token_ids + list(output.outputs[0].token_ids) for output in outputs]


def compare_quantizations(args: argparse.Namespace) -> None:
    """Top-1 agreement and mean KL(dequantized || quantized) per token, teacher-forced as for the KV
    cache dtypes: the same sequences, read in one prefill by each model (the quantized ones in args.dtype)."""
    from pagedllm import LLM
    from pagedllm.worker.model_runner import allocate_kv_caches

    model = str(float_copy_of_bundled_model()) if args.float_bundled else args.model
    reference_llm = LLM(model, dtype="float32", quantization="none", kv_cache_memory="1GiB")
    sequences = teacher_sequences(reference_llm, args.continuation_len)
    runner = reference_llm.llm_engine.runner
    num_blocks = -(-max(map(len, sequences)) // runner.block_size)

    def logprobs_of(llm) -> list:
        engine = llm.llm_engine
        caches = allocate_kv_caches(engine.model_config, num_blocks, runner.block_size, engine.kv_cache_dtype,
                                    runner.device)
        return [sequence_logprobs(engine.runner, sequence, caches) for sequence in sequences]

    references = logprobs_of(reference_llm)
    rows = []
    for quantization in args.quantizations:
        for activation_dtype in args.activation_dtypes:
            llm = LLM(model, dtype=args.dtype, quantization=quantization, activation_dtype=activation_dtype,
                      kv_cache_memory="1GiB")
            agreeing, divergence = 0, 0.0
            for reference, candidate in zip(references, logprobs_of(llm)):
                agreeing += int((candidate.argmax(-1) == reference.argmax(-1)).sum())
                divergence += float((reference.exp() * (reference - candidate)).sum())
            cache = str(llm.llm_engine.kv_cache_dtype).removeprefix("torch.")
            rows.append((quantization, activation_dtype, cache, llm.llm_engine.model_info().weight_summary,
                         agreeing, divergence))
            del llm
    positions = sum(map(len, sequences))
    print(f"{model or 'bundled model'}: {len(sequences)} chat prompts, each continued by {args.continuation_len} "
          f"tokens the dequantized model sampled ({positions} positions); the reference: quantization=none, float32 "
          f"activations and KV cache; the quantized runs in dtype {args.dtype}")
    print("| quantization | activation_dtype | KV cache | weights | top-1 agreement | mean KL per token (nats) |")
    print("|---|---|---|---|---|---|")
    for quantization, activation_dtype, cache, summary, agreeing, divergence in rows:
        print(f"| {quantization} | {activation_dtype} | {cache} | {summary} | {agreeing / positions:.2%} "
              f"| {divergence / positions:.2e} |")


def float_copy_of_bundled_model():
    """A float32 safetensors folder of the bundled model (transformers' own dequantization of its GGUF),
    written once: the float checkpoint int8/int4 are measured on, with nothing downloaded."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.model.loader import bundled_model_path
    from pagedllm.tokenizer import tokenizer_cache_dir

    folder = tokenizer_cache_dir().parent / "smollm2-135m-float32"   # beside the synthetic GGUFs
    if not (folder / "model.safetensors").is_file():
        gguf_path = bundled_model_path()
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # transformers will not save a model it loaded from a GGUF: write its float tensors and config ourselves
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"}
        folder.mkdir(parents=True, exist_ok=True)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(folder)
        save_file(state, folder / "model.safetensors")
        AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(folder)
    return folder
