"""Where a constrained decode step's time goes (issue 27): batch 64 on the default engine, decode steps only.

Runs `bench structured`'s three modes (64 plain, 64 under its JSON schema, 32 + 32 mixed) on one engine and
prints, per mode, the median time of the steps in which all 64 decode and torch.profiler's operators
over one more run of the mode's decode steps (self CPU time per step), then the operators whose time moved most against plain. With
`--flush-denormal`, denormal floats are flushed to zero (torch.set_flush_denormal) before the engine starts,
to test whether they are what a mode adds. Run it in a benchmark window:
`python scripts/profile_structured.py [--flush-denormal] [--steps 12]`.
"""
import argparse
import collections
import statistics

import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.bench.structured_outputs import SCHEMA
from pagedllm.bench.workload import random_workload

BATCH = 64


def decode_steps(engine, prompts, params_list, tag, profiler=None) -> list[float]:
    """Runs the requests to their end and returns the model-side time of each step in which all of them decode;
    a profiler given is started after the first such step (so the prefill stays out) and stopped at the end."""
    for index, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"{tag}-{index}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step_stats
        if stats.num_seqs == BATCH and stats.num_tokens == BATCH:
            if profiler is not None and not times:
                profiler.start()
            times.append(stats.scheduling_seconds + stats.prepare_seconds + stats.model_seconds)
    if profiler is not None:
        profiler.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flush-denormal", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    args = parser.parse_args()
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=BATCH, kv_cache_memory="1GiB",
              max_model_len=32 + args.steps + 16, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompts = [item.prompt_token_ids for item in random_workload(num=BATCH, in_min=32, in_max=32,
                                                                   vocab=engine.model_config.vocab_size)]
    plain = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    structured = SamplingParams(temperature=0, max_tokens=args.steps,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
    modes = {"plain": [plain] * BATCH, "structured": [structured] * BATCH,
             "mixed": [structured if index % 2 else plain for index in range(BATCH)]}
    engine.structured_output.request_grammar(structured.structured_outputs).compiled.result()
    decode_steps(engine, prompts, modes["mixed"], "warm-up")
    walls, tables = {}, {}
    for mode, params in modes.items():
        walls[mode] = decode_steps(engine, prompts, params, f"time-{mode}") + \
            decode_steps(engine, prompts, params, f"time2-{mode}")
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        steps = decode_steps(engine, prompts, params, f"profile-{mode}", profiler)
        per_step = collections.Counter()
        for event in profiler.key_averages():
            per_step[event.key] += event.self_cpu_time_total / 1e3 / (len(steps) - 1)
        tables[mode] = per_step
        print(f"\n=== {mode}: median step {statistics.median(walls[mode]) * 1e3:.2f} ms over {len(walls[mode])} "
              f"steps (flush denormal {args.flush_denormal}, {torch.get_num_threads()} threads)")
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=50))
    print("\n=== self CPU ms per step, against plain (largest moves)")
    keys = set().union(*tables.values())
    moved = sorted(keys, key=lambda key: -abs(tables["structured"][key] - tables["plain"][key]))[:15]
    for key in moved:
        print(f"  {key[:50]:50s} plain {tables['plain'][key]:8.2f}  structured {tables['structured'][key]:8.2f}  "
              f"mixed {tables['mixed'][key]:8.2f}")


if __name__ == "__main__":
    main()
