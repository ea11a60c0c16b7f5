"""Each `pagedllm bench` subcommand that makes a README figure, run on a tiny setting: it prints its table,
with the header the README shows and one row per setting asked for (counted here from the arguments).
The figures themselves are timings and are not checked."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints import cli

# The module's server (conftest's `server` fixture), started only for the serving benchmark's test.
SERVER_FLAGS = ("--kv-cache-memory", "32MiB", "--max-model-len", "256", "--served-model-name", "smollm2")


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_model_dir, tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("bench"), "llama"))


def table_rows(out: str, header: str) -> list[str]:
    """The data rows of the markdown table that starts with header."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    assert lines[start + 1].startswith("|---"), lines[start:start + 2]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def tiny_workload(tmp_path) -> str:
    """A workload file in the shared format, with token ids inside the tiny model's vocabulary."""
    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps({"prompt_token_ids": list(range(10 + i, 30 + i)), "max_tokens": 4}) + "\n"
                                for i in range(4)))
    return str(workload)


def run_bench(capsys, *argv: str) -> str:
    args = cli.parse_args(["bench", *argv])
    args.handler(args)
    return capsys.readouterr().out


def test_throughput_prints_a_row_per_quantization_and_kv_cache_dtype(tiny_dir, capsys, tmp_path):
    """Each row's engine was built with its values: the KV cache dtype is the one the engine resolved."""
    figures = tmp_path / "figures.json"
    out = run_bench(capsys, "throughput", tiny_dir, "--dataset", str(tiny_workload(tmp_path)),
                    "--dtype", "float32", "--quantization", "none,int8", "--kv-cache-dtype", "auto,bfloat16",
                    "--kv-cache-memory", "8MiB", "--output-json", str(figures))
    rows = table_rows(out, "| backend | dtype | wall s | req/s | output tok/s | total tok/s |")
    assert len(rows) == 4 and all(row.split("|")[1].strip().startswith("pagedllm") for row in rows)
    results = json.loads(figures.read_text())
    assert [("quantization=int8" in r["backend"], r["kv_cache_dtype"]) for r in results] == [
        (False, "float32"), (False, "bfloat16"), (True, "float32"), (True, "bfloat16")]


def test_throughput_prints_a_row_per_activation_dtype(tiny_dir, capsys, tmp_path):
    figures = tmp_path / "figures.json"
    out = run_bench(capsys, "throughput", tiny_dir, "--dataset", str(tiny_workload(tmp_path)), "--dtype", "float32",
                    "--quantization", "int8", "--activation-dtype", "auto,int8", "--kv-cache-memory", "8MiB",
                    "--output-json", str(figures))
    rows = table_rows(out, "| backend | dtype | wall s | req/s | output tok/s | total tok/s |")
    labels = ["pagedllm (quantization=int8, cascade=auto)",
              "pagedllm (quantization=int8, activation_dtype=int8, cascade=auto)"]
    assert [row.split("|")[1].strip() for row in rows] == labels
    assert [r["activation_dtype"] for r in json.loads(figures.read_text())] == ["auto", "int8"]


def test_memory_prints_its_utilisation_tables(capsys):
    out = run_bench(capsys, "memory", "--skip-model", "--kv-budget-tokens", "2048", "--max-model-len", "256")
    assert table_rows(out, "| block size | paged | reserve max_model_len (256) | reserve prompt+max_tokens |")


def test_cascade_prints_a_row_per_group_and_prefix(capsys):
    out = run_bench(capsys, "cascade", "--group-sizes", "2,4", "--shared-lens", "32", "--reps", "1")
    rows = table_rows(out, "| sequences | shared keys | plain µs | cascade µs | speed-up |")
    assert [row.split("|")[1:3] for row in rows] == [[" 2 ", " 32 "], [" 4 ", " 32 "]]


def test_kernels_prints_a_row_per_shape_format_and_row_count(capsys):
    out = run_bench(capsys, "kernels", "--rows", "1,3", "--min-time", "0.001")
    rows = table_rows(out, "| out x in | format | rows |")
    assert rows and {row.split("|")[3].strip() for row in rows} == {"1", "3"}


def test_kernels_attention_prints_a_row_per_prompt_length_and_decode_context(capsys):
    out = run_bench(capsys, "kernels", "--attention", "--prompt-lens", "16,40", "--decode-contexts", "8,33",
                    "--decode-sequences", "3", "--dtype", "float32", "--min-time", "0.001")
    rows = table_rows(out, "| prompt | tiles ms |")
    assert [row.split("|")[1].strip() for row in rows] == ["16", "40"]
    assert "float32 model and cache" in out
    assert [row.split("|")[1].strip() for row in table_rows(out, "| context | ms | K/V GB/s |")] == ["8", "33"]


def test_kernels_attention_times_the_cache_dtype_asked_for(capsys):
    """--kv-cache-dtype: both tables run over that cache, and their headers name the model's and the cache's
    dtypes."""
    out = run_bench(capsys, "kernels", "--attention", "--prompt-lens", "16", "--decode-contexts", "8",
                    "--decode-sequences", "3", "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
                    "--min-time", "0.001")
    assert out.count("float32 model, bfloat16 cache") == 2
    assert len(table_rows(out, "| prompt | tiles ms |")) == 1


def test_latency_prints_a_row_per_batch_size(tiny_dir, capsys):
    out = run_bench(capsys, "latency", tiny_dir, "--batch-size", "1,2", "--input-len", "8", "--output-len", "3",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--quantization", "none")
    rows = table_rows(out, "| quantization | dtype | speculative | dataset | batch |")
    assert [row.split("|")[5].strip() for row in rows] == ["1", "2"]


def test_latency_samples_with_temperature_and_top_p(tiny_dir, capsys):
    out = run_bench(capsys, "latency", tiny_dir, "--batch-size", "2", "--input-len", "8", "--output-len", "3",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--quantization", "none",
                    "--temperature", "0.7", "--top-p", "0.9")
    assert "temperature 0.7, top-p 0.9" in out
    assert len(table_rows(out, "| quantization | dtype | speculative | dataset | batch |")) == 1


def test_sweep_prints_a_row_per_block_size_and_writes_its_plot(tiny_dir, capsys, tmp_path):
    plot = tmp_path / "sweep.png"
    out = run_bench(capsys, "sweep", tiny_dir, "--dataset", tiny_workload(tmp_path), "--dtype", "float32",
                    "--block-sizes", "8", "16", "--plot", str(plot))
    rows = table_rows(out, "| block size | output tok/s | KV waste |")
    assert [row.split("|")[1].strip() for row in rows] == ["8", "16"]
    assert plot.stat().st_size > 0


def test_scheduling_prints_its_split_of_the_step(tiny_dir, capsys):
    out = run_bench(capsys, "scheduling", tiny_dir, "--num-seqs", "4", "--steps", "3", "--prompt-len", "16",
                    "--dtype", "float32")
    rows = table_rows(out, "| per step | median | p99 | share of step time |")
    assert [row.split("|")[1].strip() for row in rows] == ["scheduler + KV bookkeeping", "step preparation", "both"]


def test_structured_prints_a_row_per_mode(tiny_dir, capsys):
    out = run_bench(capsys, "structured", tiny_dir, "--batch", "2", "--steps", "2", "--rounds", "1",
                    "--prompt-len", "8", "--dtype", "float32")
    rows = table_rows(out, "| batch of decode steps | median step | p90 | against plain |")
    assert [row.split("|")[1].strip() for row in rows] == ["2 plain", "2 under a JSON schema",
                                                           "1 plain + 1 under the schema"]


def test_logit_controls_prints_its_decode_steps_greedy_and_sampled(capsys):
    out = run_bench(capsys, "logit-controls", "--parts", "decode", "--batch-size", "2", "--decode-steps", "2",
                    "--decode-rounds", "1", "--dtype", "float32")
    lines = out.splitlines()
    for kind in ("greedy", "sampled"):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"decode step on the model, {kind}, batch 2"))
        assert [line.split("  ")[1].strip() for line in lines[start + 1:start + 3]] == [
            "no row with controls", "every row with controls"]
        assert lines[start + 3].startswith("  controls against plain, median of 1 rounds' ratios: ")
    assert "sampling step" not in out and "prefill" not in out   # only the part asked for


def test_logit_controls_refuses_an_unknown_part(capsys):
    with pytest.raises(ValueError, match="--parts"):
        run_bench(capsys, "logit-controls", "--parts", "decode,forward")


def test_accuracy_prints_its_agreement_table(tiny_dir, capsys):
    out = run_bench(capsys, "accuracy", tiny_dir, "--num-prompts", "2", "--max-tokens", "4", "--no-chat")
    assert len(table_rows(out, "| identical sequences | mean common prefix | same token at a position |")) == 1


def test_serving_counts_every_request_and_prints_its_latency_table(server, capsys):
    out = run_bench(capsys, "serving", "--base-url", server.url, "--num-prompts", "3", "--input-len", "8",
                    "--output-len", "4", "--max-concurrency", "2")
    assert "3 requests (closed loop, 2 clients): 3 completed, 0 errors" in out
    rows = table_rows(out, "| ms | mean | p50 | p90 | p99 |")
    assert [row.split("|")[1].strip() for row in rows] == ["TTFT", "TPOT", "ITL", "E2E latency"]


def test_multi_turn_compares_prefix_and_least_loaded_routing_over_two_ray_replicas(tiny_dir, capsys, monkeypatch):
    """3 conversations of 40 random tokens, then each history (+ 2 answer + 8 question tokens = 50) again. Turn 1
    spreads them 2/1 over the replicas; in turn 2 prefix routing sends each to its own history, whose 41 computed
    tokens left 5 full blocks of 8: 3 x 40 = 120 hit tokens out of 3 x 40 + 3 x 50 = 270 looked up. Least-loaded
    sends each to the other replica (c0 to replica 1, given fewer; c1 to replica 0, with none in flight; c2 to
    replica 1, given fewer again): no hit."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'pagedllm[ray]'")
    monkeypatch.setenv("RAY_ADDRESS", "local")   # a Ray cluster of its own, stopped with the replicas
    out = run_bench(capsys, "multi-turn", tiny_dir, "--dtype", "float32", "--block-size", "8", "--conversations", "3",
                    "--turns", "2", "--system-len", "40", "--question-len", "8", "--output-len", "2",
                    "--ram-fraction", "1", "--data-parallel-size", "2")
    rows = table_rows(out, "| routing | TTFT ms p50 | p99 | output tok/s | prefix-hit prompt tokens | prefix hit rate")
    cells = [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows]
    assert [(row[0], row[4], row[5], row[6]) for row in cells] == [("prefix", "120", "44.4%", "3"),
                                                                   ("least-loaded", "0", "0.0%", "0")]


def test_multi_turn_refuses_a_routing_without_replicas(tiny_dir, capsys):
    with pytest.raises(ValueError, match="--data-parallel-routing compares replica routings: it needs "
                                         "--data-parallel-size > 1, got 1"):
        run_bench(capsys, "multi-turn", tiny_dir, "--data-parallel-routing", "prefix")


def test_multi_turn_prints_a_row_with_the_disk_tier_off_and_on(tiny_dir, capsys):
    out = run_bench(capsys, "multi-turn", tiny_dir, "--dtype", "float32", "--block-size", "8", "--conversations", "3",
                    "--turns", "2", "--system-len", "40", "--question-len", "8", "--output-len", "2",
                    "--restart-prompt-len", "40", "--preempt-requests", "2", "--preempt-prompt-len", "20",
                    "--preempt-output-len", "28", "--preempt-step-tokens", "8")
    # history 40 + 8 + 2 * 2 = 52 tokens, 7 blocks each: working set 21 blocks, a pool of max(7, 5) = 7
    assert "KV working set 21 blocks, RAM pool 7 blocks of 8 tokens" in out
    rows = table_rows(out, "| KV disk tier | TTFT ms p50 | p99 | output tok/s | prefix-hit prompt tokens |")
    assert [row.split("|")[1].strip() for row in rows] == ["off", "on"]
    disk_hits = [int(row.split("|")[6]) for row in rows]
    assert disk_hits[0] == 0 and disk_hits[1] > 0   # the second turns find their histories on disk
    # The restart case: 40 tokens, 5 blocks, of which the lookup (all but the last token) finds 4 after the restart.
    restart = table_rows(out, "| case | TTFT ms | disk hit blocks |")
    assert [(row.split("|")[1].strip(), int(row.split("|")[3])) for row in restart] == [("cold", 0),
                                                                                       ("after restart", 4)]
    # Preemption: 2 requests of 20 tokens (3 blocks each) in a pool of 2 x 3 + 1 blocks, each decoding 28 tokens
    # to 48 (6 blocks): the later one is preempted and the first's growth evicts two of its cached blocks;
    # recompute computes their tokens again, swap none.
    modes = table_rows(out, "| preemption mode | seconds |")
    assert [row.split("|")[1].strip() for row in modes] == ["recompute", "swap", "auto"]
    figures = {row.split("|")[1].strip(): [int(cell) for cell in row.split("|")[4:7]] for row in modes}
    preemptions, swapped, recomputed = figures["recompute"]
    assert preemptions >= 1 and swapped == 0 and recomputed > 0
    preemptions, swapped, recomputed = figures["swap"]
    assert preemptions >= 1 and swapped == preemptions and recomputed == 0
    # Late: one request of 20 tokens (3 blocks) decoding, then one more at a higher priority, 8 tokens a step, in a
    # pool of 6 + 1 + 1 blocks: the high one's growth preempts the low one after its prompt is computed; recompute
    # computes tokens again when it resumes (at least its last, partly filled block), swap none.
    late = table_rows(out, "| preemption mode, late | seconds |")
    assert "in a pool of 8 blocks, 8 tokens a step" in out
    late_figures = {row.split("|")[1].strip(): [int(cell) for cell in row.split("|")[4:7]] for row in late}
    preemptions, swapped, late_recomputed = late_figures["recompute"]
    assert preemptions >= 1 and swapped == 0 and late_recomputed > 0
    preemptions, swapped, recomputed = late_figures["swap"]
    assert preemptions >= 1 and swapped == preemptions and recomputed == 0


def test_throughput_and_latency_with_random_loras_run_beside_the_base(tiny_dir, capsys, tmp_path):
    """--num-loras: adapters made with peft over every linear layer; the base alone and with them, side by side."""
    out = run_bench(capsys, "throughput", tiny_dir, "--dataset", str(tiny_workload(tmp_path)), "--dtype", "float32",
                    "--quantization", "none", "--kv-cache-memory", "8MiB", "--num-loras", "2", "--lora-rank", "8")
    rows = table_rows(out, "| backend | dtype | wall s | req/s | output tok/s | total tok/s |")
    assert [row.split("|")[1].strip() for row in rows] == ["pagedllm (quantization=none, cascade=auto)",
                                                          "pagedllm (quantization=none, cascade=auto, 2 LoRAs)"]
    assert "2 LoRAs) against pagedllm (quantization=none, cascade=auto), output tok/s:" in out
    out = run_bench(capsys, "latency", tiny_dir, "--batch-size", "1", "--input-len", "8", "--output-len", "3",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--quantization", "none",
                    "--num-loras", "1", "--lora-rank", "8")
    rows = table_rows(out, "| quantization | dtype | speculative | dataset | batch |")
    assert [row.split("|")[-2].strip() for row in rows] == ["none", "adapter-0"]


ALTERNATION_HEADER = "| dataset | batch | round | configuration | decode step ms p50 | decode tok/s | time a token"


def alternation_cells(out: str) -> list[list[str]]:
    return [[cell.strip() for cell in row.split("|")[1:-1]] for row in table_rows(out, ALTERNATION_HEADER)]


def test_latency_alternates_the_base_and_an_adapter_round_by_round(tiny_dir, capsys):
    """--alternate-rounds: a row per configuration and round with its step p50, tok/s and time a token against
    the first configuration's (the first's tok/s over its), its prefill p50 over the first's, then each other
    configuration's median ratios."""
    out = run_bench(capsys, "latency", tiny_dir, "--batch-size", "1", "--input-len", "8", "--output-len", "3",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--quantization", "none",
                    "--num-loras", "1", "--lora-rank", "8", "--alternate-rounds", "3")
    cells = alternation_cells(out)
    base, adapter = "none, speculative none, LoRA none", "none, speculative none, LoRA adapter-0"
    assert [(row[2], row[3]) for row in cells] == [(str(r), label) for r in (1, 2, 3) for label in (base, adapter)]
    ratios, prefill_ratios = [], []
    for first, other in zip(cells[::2], cells[1::2]):   # tok/s and ms printed to 0.05, ratios to 0.0005
        assert first[6] == first[8] == "1.000"
        rate_first, rate_other, ratio = float(first[5]), float(other[5]), float(other[6])
        assert (rate_first - 0.05) / (rate_other + 0.05) - 0.0005 <= ratio <= \
            (rate_first + 0.05) / (rate_other - 0.05) + 0.0005
        ratios.append(ratio)
        prefill_first, prefill_other, prefill_ratio = float(first[7]), float(other[7]), float(other[8])
        assert (prefill_other - 0.05) / (prefill_first + 0.05) - 0.0005 <= prefill_ratio <= \
            (prefill_other + 0.05) / (prefill_first - 0.05) + 0.0005
        prefill_ratios.append(prefill_ratio)
    ratios.sort()
    prefill_ratios.sort()
    assert f"dataset random, batch 1, {adapter}: median ratio {ratios[1]:.3f} (min {ratios[0]:.3f}, " \
           f"max {ratios[2]:.3f}) over 3 rounds; prefill median ratio {prefill_ratios[1]:.3f} " \
           f"(min {prefill_ratios[0]:.3f}, max {prefill_ratios[2]:.3f}) over 3 rounds" in out


def test_latency_alternates_quantizations_and_speculative_configs(tiny_dir, capsys):
    """Every configuration of the sweep takes part, each against the first; no adapter is needed."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'
    out = run_bench(capsys, "latency", tiny_dir, "--batch-size", "1", "--input-len", "8", "--output-len", "3",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--quantization", "none",
                    "--speculative-config", "none", "--speculative-config", ngram, "--alternate-rounds", "2")
    labels = ["none, speculative none, LoRA none", f"none, speculative {ngram}, LoRA none"]
    assert [row[3] for row in alternation_cells(out)] == labels * 2
    assert f"dataset random, batch 1, {labels[1]}: median ratio" in out
    assert f"dataset random, batch 1, {labels[0]}: median" not in out


def test_latency_alternates_activation_dtypes(tiny_dir, capsys):
    """--activation-dtype a,b: an engine each, labelled by the value where it is not auto."""
    out = run_bench(capsys, "latency", tiny_dir, "--batch-size", "1", "--input-len", "8", "--output-len", "3",
                    "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32", "--quantization", "int8",
                    "--activation-dtype", "model,auto", "--alternate-rounds", "2")
    labels = ["int8, activation_dtype=model, speculative none, LoRA none", "int8, speculative none, LoRA none"]
    assert [row[3] for row in alternation_cells(out)] == labels * 2
    assert f"dataset random, batch 1, {labels[1]}: median ratio" in out


def test_latency_alternation_needs_two_configurations(tiny_dir, capsys):
    with pytest.raises(ValueError, match=r"--alternate-rounds alternates configurations: give two or more"):
        run_bench(capsys, "latency", tiny_dir, "--alternate-rounds", "2")
