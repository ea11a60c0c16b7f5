"""Speculation configured above its disable_by_batch_size (issue 27's "no slower than 3%" row): is a capped
engine's decode step any slower than an engine without speculation?

`bench latency` measures one engine after the other, so drift of the machine falls on one side. Here both
engines (none; ngram in the default engine, a draft model in float32) live in one process and their runs
alternate: the random workload (128-token prompts, 48 greedy tokens) at batch sizes above the cap, three
rounds after a warm-up; printed per engine and batch: decode tok/s (median run) and the
median of each part of a decode step (scheduling, preparation, model), so a difference shows where it sits.
Run it in a benchmark window: `python scripts/profile_speculation_capped.py`.
"""
import statistics

from pagedllm import LLM, SamplingParams
from pagedllm.bench.workload import random_workload
from pagedllm.model.loader import bundled_model_path

DRAFT = str(bundled_model_path())
# (engine settings, the batches to run, the speculative config compared against none)
PAIRS = [(dict(), (8, 16), {"method": "ngram", "num_speculative_tokens": 4}),
         (dict(dtype="float32", quantization="none"), (4, 8),
          {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4, "quantization": "auto"})]
OUTPUT_LEN = 48


def run(llm: LLM, batch: int, seed: int) -> tuple[float, list[tuple[float, float, float]]]:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for index, item in enumerate(random_workload(num=batch, in_min=128, in_max=128,
                                                 vocab=engine.model_config.vocab_size, seed=seed)):
        engine.add_request(f"{seed}-{batch}-{index}", {"prompt_token_ids": item.prompt_token_ids}, params)
    engine.step()   # the prefill
    parts = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.last_step_stats
        parts.append((stats.scheduling_seconds, stats.prepare_seconds, stats.model_seconds))
    return batch * (OUTPUT_LEN - 1) / sum(map(sum, parts)), parts


def main() -> None:
    for settings, batches, config in PAIRS:
        llms = {label: LLM(max_num_seqs=max(batches), enable_prefix_caching=False, kv_cache_memory="512MiB",
                           speculative_config=spec, **settings)
                for label, spec in (("none", None), (config["method"] + " k=4, default cap", config))}
        for batch in batches:
            rates = {name: [] for name in llms}
            parts = {name: [] for name in llms}
            for round_index in range(4):
                for name in (llms if round_index % 2 else list(llms)[::-1]):
                    rate, steps = run(llms[name], batch, seed=round_index)
                    if round_index:   # the first round warms up
                        rates[name].append(rate)
                        parts[name] += steps
            for name in llms:
                medians = [statistics.median(part[i] for part in parts[name]) * 1e3 for i in range(3)]
                print(f"{settings or 'default engine'} batch {batch:3d} {name:28s} "
                      f"{statistics.median(rates[name]):7.1f} decode tok/s (runs "
                      f"{', '.join(f'{rate:.1f}' for rate in rates[name])}); step ms: scheduling {medians[0]:.2f}, "
                      f"preparation {medians[1]:.2f}, model {medians[2]:.2f}")
        for llm in llms.values():
            llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
