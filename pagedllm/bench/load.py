"""`pagedllm bench load`: the memory and time of loading a model through `LLM(model, ...)`.

Each load runs in a fresh process (multiprocessing spawn), so that its peak RSS is its own. That process
imports torch and pagedllm, records its RSS (the baseline), resets the kernel's peak-RSS mark, calls
LLM(), then reads the peak. Reported: load time, RSS before LLM(), peak RSS, RSS after (and how much of
what the load added maps files), the final weight bytes (the storages of the model's parameters and
buffers, each once) and the KV pool bytes. The check is issue 13's streaming-load rule, applied to the
growth: peak - baseline <= weights + KV pool + 300 MB.

The KV pool is calloc'd, so its pages are not resident until written; the bench's default
--kv-cache-memory is therefore small (not the engine's 4 GiB), so the KV term cannot hide a load's
transient copies. --synthetic-1b adds a ~1B-parameter Q4_0/Q4_K Llama GGUF that the bench writes once.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from pagedllm.config import DTYPES, EngineConfig

ALLOWED_OVERHEAD_BYTES = 300 * 10**6   # issue 13: peak RSS within final weights + KV pool + 300 MB
DEFAULT_KV_CACHE_MEMORY = "256MiB"
_MB = 10**6


@dataclass(frozen=True)
class LoadMeasurement:
    """One load, measured inside its own process; sizes in bytes."""
    model: str
    load_seconds: float
    baseline_rss: int    # after importing torch and pagedllm, just before LLM()
    peak_rss: int        # the highest RSS while LLM() ran
    final_rss: int       # when LLM() returned
    baseline_file_rss: int   # the file-backed parts (RssFile) of baseline_rss and final_rss: mapped
    final_file_rss: int      # libraries, and the checkpoint while a loader keeps it mmap'd
    weight_bytes: int
    kv_pool_bytes: int

    @property
    def growth(self) -> int:
        return self.peak_rss - self.baseline_rss

    @property
    def file_growth(self) -> int:
        return self.final_file_rss - self.baseline_file_rss

    @property
    def allowed_growth(self) -> int:
        return self.weight_bytes + self.kv_pool_bytes + ALLOWED_OVERHEAD_BYTES

    @property
    def passed(self) -> bool:
        return self.growth <= self.allowed_growth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="model folder, GGUF file or cached Hugging Face name (default: the bundled model)")
    parser.add_argument("--synthetic-1b", action="store_true",
                        help="also load a synthetic ~1B-parameter Llama GGUF (random Q4_0/Q4_K weights, the bundled "
                             "tokenizer), written once by the bench and reused")
    parser.add_argument("--synthetic-path", type=Path, default=None,
                        help="where that file is kept (default: ~/.cache/pagedllm/synthetic-llama-<digest>.gguf, "
                             "or under $PAGEDLLM_CACHE_DIR)")
    parser.add_argument("--quantization", default=None,
                        help="auto, none, int8 or int4; passed to LLM() only when given (default: the engine's)")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="passed to LLM() when given")
    parser.add_argument("--device", default="cpu",
                        help="where the model goes; RSS measures host memory, so cpu is the meaningful case "
                             "(default: cpu)")
    parser.add_argument("--kv-cache-memory", default=DEFAULT_KV_CACHE_MEMORY,
                        help=f"KV pool size (default: {DEFAULT_KV_CACHE_MEMORY}, small so that it cannot hide "
                             "transient copies in the check)")


def run(args: argparse.Namespace) -> None:
    kwargs = llm_kwargs(args)
    models: list[str | None] = [args.model]
    if args.synthetic_1b:
        models.append(str(_synthetic_1b(args.synthetic_path)))
    print(f"each load in a fresh process: LLM(model, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
    print_table([measure_load(model, kwargs) for model in models])


def llm_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The LLM() keywords the bench passes: only the options that are set, so that keywords newer than
    this bench (quantization) are never sent unasked. Checked here, before any process starts."""
    kwargs = {name: getattr(args, name) for name in ("quantization", "dtype", "device", "kv_cache_memory")
              if getattr(args, name) is not None}
    try:
        EngineConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"pagedllm bench load: {exc}") from None
    return kwargs


def _synthetic_1b(path: Path | None) -> Path:
    from pagedllm.bench.synthetic_gguf import SyntheticLlama, ensure_synthetic_gguf, synthetic_cache_path

    spec = SyntheticLlama()
    path = path or synthetic_cache_path(spec)
    if not path.is_file():
        print(f"writing the synthetic 1B model to {path} (once)")
    return ensure_synthetic_gguf(path, spec)


def measure_load(model: str | None, kwargs: dict[str, object]) -> LoadMeasurement:
    """Loads `model` with LLM(model, **kwargs) in a fresh spawned process and returns what it measured;
    a failed or killed load (the OOM killer, say) raises RuntimeError with the cause."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_measure_in_this_process,
                              args=(model, kwargs, sender, logging.getLogger().getEffectiveLevel()))
    process.start()
    sender.close()   # so that recv() sees end-of-file if the child dies without answering
    try:
        outcome, payload = receiver.recv()
    except EOFError:
        outcome, payload = "died", None
    process.join()
    if outcome == "ok":
        return payload
    cause = payload or f"the process ended with exit code {process.exitcode} without a result"
    raise RuntimeError(f"loading {model or 'the bundled model'} failed: {cause}")


def _measure_in_this_process(model: str | None, kwargs: dict[str, object], sender, log_level: int) -> None:
    """The child's side: sends ("ok", LoadMeasurement) or ("error", traceback text)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from pagedllm import LLM   # torch with it: imports are not part of the load

        baseline, baseline_file = _rss_bytes("VmRSS"), _rss_bytes("RssFile")
        _reset_peak_rss()
        start = time.perf_counter()
        llm = LLM(model, **kwargs)
        load_seconds = time.perf_counter() - start
        info = llm.llm_engine.model_info()
        sender.send(("ok", LoadMeasurement(
            model=model or "bundled", load_seconds=load_seconds, baseline_rss=baseline,
            peak_rss=_rss_bytes("VmHWM"), final_rss=_rss_bytes("VmRSS"),
            baseline_file_rss=baseline_file, final_file_rss=_rss_bytes("RssFile"),
            weight_bytes=info.weight_bytes, kv_pool_bytes=info.kv_pool_bytes)))
    except Exception:   # any failure, reported to the parent whole
        sender.send(("error", traceback.format_exc()))
    finally:
        sender.close()


def _rss_bytes(key: str) -> int:
    """VmRSS (resident now), RssFile (its file-backed part) or VmHWM (the peak since start or the last
    reset) from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key} line (pagedllm bench load needs Linux)")


def _reset_peak_rss() -> None:
    """Sets VmHWM back to the current RSS (Linux's clear_refs "5"), so the peak read later is the
    load's, not that of an import that allocated and freed more."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def print_table(measurements: list[LoadMeasurement]) -> None:
    print("growth = peak RSS - RSS before LLM() (after importing torch and pagedllm); check: "
          f"growth <= weights + KV pool + {ALLOWED_OVERHEAD_BYTES // _MB} MB; MB = 10^6 bytes")
    print("file-backed growth = RssFile after - before: the part of the RSS the load added that maps files, "
          "such as an mmap'd checkpoint's pages, which the kernel may drop")
    print("| model | load s | RSS before LLM() MB | peak RSS MB | RSS after MB | file-backed growth MB | weights MB "
          "| KV pool MB | growth MB | allowed MB | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in measurements:
        sizes = (m.baseline_rss, m.peak_rss, m.final_rss, m.file_growth, m.weight_bytes, m.kv_pool_bytes,
                 m.growth, m.allowed_growth)
        print(f"| {Path(m.model).name} | {m.load_seconds:.1f} | "
              + " | ".join(f"{size / _MB:.0f}" for size in sizes)
              + f" | {'pass' if m.passed else 'FAIL'} |")
    for m in measurements:
        if not m.passed:
            print(f"FAIL {m.model}: peak RSS grew {m.growth / _MB:.0f} MB during load, more than "
                  f"{m.allowed_growth / _MB:.0f} MB allowed ({m.weight_bytes / _MB:.0f} weights + "
                  f"{m.kv_pool_bytes / _MB:.0f} KV pool + {ALLOWED_OVERHEAD_BYTES // _MB})")
