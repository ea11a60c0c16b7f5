"""Where a speculative step's time goes (issue 27): batch 1, copy-heavy prompts, greedy, 64 tokens.

For each engine (the default: quantized weights in the CPU's dtype; float32 dequantized) with speculation off
and n-gram k = 4: decode tok/s over three requests after two warm-ups, the median model time of the steps by
their row count (1: a plain decode step; 1 + k: a verification), and torch.profiler's operators over one more
request. Run it in a benchmark window: `python scripts/profile_speculation.py [config indices, e.g. 2,3]`.
"""
import collections
import statistics
import sys

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.bench.copy_workload import copy_heavy_workload

CONFIGS = [(dtype, quantization, speculative)
           for dtype, quantization in [("auto", "auto"), ("float32", "none")]
           for speculative in [None, {"method": "ngram", "num_speculative_tokens": 4}]]


def profile(dtype: str, quantization: str, speculative: dict | None) -> None:
    llm = LLM(dtype=dtype, quantization=quantization, enable_prefix_caching=False, max_num_seqs=1,
              speculative_config=speculative)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    model_seconds = collections.defaultdict(list)   # by the step's row count

    def run(seed: int) -> float:
        """One request's decode time (its prefill step left out)."""
        item = copy_heavy_workload(engine.tokenizer, 1, 64, seed=seed)[0]
        engine.add_request(f"r{seed}", {"prompt_token_ids": item.prompt_token_ids}, params)
        engine.step()
        total = 0.0
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.last_step_stats
            total += stats.scheduling_seconds + stats.prepare_seconds + stats.model_seconds
            model_seconds[stats.num_tokens].append(stats.model_seconds)
        return total

    run(0), run(1)
    decode = sum(run(seed) for seed in (2, 3, 4))
    print(f"\n=== dtype {dtype}, quantization {quantization}, speculative {speculative}: "
          f"{3 * 63 / decode:.1f} decode tok/s, {torch.get_num_threads()} threads")
    for rows, times in sorted(model_seconds.items()):
        print(f"  {rows} rows: {len(times)} steps, model ms p50 {statistics.median(times) * 1e3:.2f}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        run(5)
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=45))
    engine.shutdown()


if __name__ == "__main__":
    chosen = [int(index) for index in sys.argv[1].split(",")] if len(sys.argv) > 1 else range(len(CONFIGS))
    for index in chosen:
        profile(*CONFIGS[index])
