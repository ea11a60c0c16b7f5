"""The peer's batch-1 figures for issue 26: OpenVINO GenAI's LLMPipeline prefilling 128 random prompt tokens (the
wall time of a one-token generate, and its own time to first token) and decoding (its time per output token),
medians over the prompts. Run with the venv of ../shared/bench/peers/setup_openvino.sh, in a benchmark window:
`$PEERS/openvino/bin/python scripts/openvino_latency.py $PEERS/smollm2-ov-int4 [prompts]`."""
import json
import statistics
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai

PROMPT_LEN = 128


def generate(pipe, new_tokens: int, seed: int) -> tuple[float, float, float]:
    """Wall seconds, time to first token (ms) and time per output token (ms) of one greedy generate."""
    ids = np.random.default_rng(seed).integers(100, 40000, size=(1, PROMPT_LEN)).astype(np.int64)
    config = genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.ignore_eos, config.do_sample = True, False
    started = time.perf_counter()
    result = pipe.generate(genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))), config)
    wall = time.perf_counter() - started
    return wall, result.perf_metrics.get_ttft().mean, result.perf_metrics.get_tpot().mean


def main() -> None:
    model, prompts = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 7
    pipe = genai.LLMPipeline(model, "CPU")
    for seed in range(3):
        generate(pipe, 8, 100 + seed)   # warm-up
    prefills = [generate(pipe, 1, seed) for seed in range(prompts)]
    decodes = [generate(pipe, PROMPT_LEN + 1, 50 + seed)[2] for seed in range(3)]
    print(json.dumps({"engine": "openvino-genai LLMPipeline", "model": model.rstrip("/").split("/")[-1],
                      "prefill_128_wall_ms_p50": round(statistics.median(w for w, _, _ in prefills) * 1e3, 2),
                      "ttft_ms_p50": round(statistics.median(t for _, t, _ in prefills), 2),
                      "tpot_ms_p50": round(statistics.median(decodes), 2)}), flush=True)


if __name__ == "__main__":
    main()
