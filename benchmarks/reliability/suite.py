"""The reliability suite: load, soak, faults, fuzzing and security checks against real `pagedllm serve`
processes (the bundled model, loopback), printed as one table. From the repository root:

    python -m benchmarks.reliability.suite [--quick]      # --quick: the variant CI runs
    python -m benchmarks.reliability.suite --simulate N   # only the model-free simulation of N requests

The simulation (`simulation.py`) steps the real engine core with the model-free executor: days of traffic in
minutes, checked for leaks and inconsistencies.

Servers: a main one started through the fault-injection hook (load, soak, client and engine faults), one
with a small float32 KV cache (preemption storm), one that is sent SIGTERM under load, one with a short
max_model_len for fuzzing, and those the security checks start for themselves.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the suite's modules load at run time: --simulate needs none of them
    from benchmarks.reliability.faults import FaultResult
    from benchmarks.reliability.fuzz import FuzzResult
    from benchmarks.reliability.load import LoadResult
    from benchmarks.reliability.security_check import SecurityCheck
    from benchmarks.reliability.soak import SoakResult

MODEL = "smollm2"
MAX_RSS_GROWTH = 0.05


@dataclass(frozen=True)
class SuiteSettings:
    clients: int = 256
    load_requests: int = 512
    soak_requests: int = 2000
    soak_wave: int = 200
    soak_concurrency: int = 32
    fuzz_examples: int = 300
    schemathesis_examples: int = 40   # per operation, for schema-valid and for schema-invalid cases
    storm_requests: int = 12
    sigterm_clients: int = 64
    kv_cache_memory: str = "512MiB"


QUICK = SuiteSettings(clients=16, load_requests=48, soak_requests=600, soak_wave=50, soak_concurrency=16,
                      fuzz_examples=40, schemathesis_examples=10, storm_requests=8, sigterm_clients=16,
                      kv_cache_memory="128MiB")   # 2,900 tokens of a float32 cache (AVX2-only CPUs' dtype): a held
                                                  # prefill's 600 + 1,000 tokens fit; 64 MiB refused it there

# The soak and the storm compare answers with the same request's answer alone: float weights (quantization
# none), as when quantized layers quantized their activations to int8, whose rounding turned the tiny
# differences between a decode step and its recomputation by prefill attention into an occasional flipped
# near-tie (int8 activations are now opt-in: activation_dtype).
MAIN_SERVER_FLAGS = ("--max-model-len", "2048", "--max-num-batched-tokens", "512", "--quantization", "none",
                     "--served-model-name", MODEL)
STORM_SERVER_FLAGS = ("--kv-cache-memory", "12MiB", "--dtype", "float32", "--quantization", "none",
                      "--max-model-len", "256", "--served-model-name", MODEL)
SIGTERM_SERVER_FLAGS = ("--kv-cache-memory", "256MiB", "--max-model-len", "1024", "--served-model-name", MODEL)
FUZZ_SERVER_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "128", "--served-model-name", MODEL)


@dataclass
class SuiteReport:
    settings: SuiteSettings
    load: LoadResult
    soak: SoakResult
    faults: list[FaultResult]
    fuzz: FuzzResult
    schema_fuzz: FuzzResult
    security: list[SecurityCheck]

    def problems(self) -> list[str]:
        """Every property the suite promises that did not hold; empty when all is well."""
        problems = []
        if self.load.errors or self.load.completed != self.load.requests or not self.load.pool_whole_after:
            problems.append("load: errors or a KV pool not whole afterwards")
        if self.soak.errors or self.soak.idle_points_whole != self.soak.idle_points:
            problems.append("soak: errors or a KV pool not whole at an idle point")
        if self.soak.rss_growth >= MAX_RSS_GROWTH:
            problems.append(f"soak: RSS grew {self.soak.rss_growth:.1%}")
        if not self.soak.probe_same:
            problems.append("soak: the probe's answer changed")
        problems += [f"fault {fault.name}: {fault.detail}" for fault in self.faults if not fault.passed]
        problems += [f"fuzz: {violation}" for violation in self.fuzz.violations + self.schema_fuzz.violations]
        problems += [f"security {check.name}: {check.detail}" for check in self.security if not check.passed]
        return problems

    def table(self) -> str:
        load, soak, fuzz = self.load, self.soak, self.fuzz
        rows = [
            ("load", f"{load.clients} clients, {load.requests} streamed chat + completion requests",
             f"{load.completed} completed, {len(load.errors)} errors; TTFT p50 {load.ttft_p50:.2f} s, "
             f"p99 {load.ttft_p99:.2f} s; {load.output_tokens_per_s:.0f} output tok/s; peak "
             f"{load.peak_running} running / {load.peak_waiting} waiting; {load.preemptions} preemptions; "
             f"pool whole after: {_yes(load.pool_whole_after)}"),
            ("soak", f"{soak.requests} requests in waves, {soak.wall_seconds:.0f} s",
             f"{soak.completed} completed, {len(soak.errors)} errors; pool whole at "
             f"{soak.idle_points_whole}/{soak.idle_points} idle points; RSS {soak.rss_second_quarter_mib:.0f} -> "
             f"{soak.rss_last_quarter_mib:.0f} MiB ({soak.rss_growth:+.1%}); probe answer same: "
             f"{_yes(soak.probe_same)}"),
            *((f"fault: {fault.name}", "pass" if fault.passed else "FAIL", fault.detail) for fault in self.faults),
            *((name, f"{result.cases} requests", ", ".join(f"{count} {status}" for status, count
                                                            in sorted(result.status_counts.items()))
               + f"; {len(result.violations)} violations")
              for name, result in (("fuzz: hypothesis bodies", fuzz), ("fuzz: schemathesis", self.schema_fuzz))),
            *((f"security: {check.name}", "pass" if check.passed else "FAIL", check.detail)
              for check in self.security),
        ]
        lines = ["| check | run | result |", "|---|---|---|"]
        lines += [f"| {name} | {run} | {result} |" for name, run, result in rows]
        return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def run_suite(settings: SuiteSettings, workdir: Path) -> SuiteReport:
    from benchmarks.reliability import faults
    from benchmarks.reliability.fault_markers import FAULT_INJECTION_LAUNCHER
    from benchmarks.reliability.fuzz import run_fuzz, run_schemathesis
    from benchmarks.reliability.load import run_load
    from benchmarks.reliability.security import run_security_checks
    from benchmarks.reliability.soak import run_soak
    from pagedllm.bench.server_process import ServerProcess

    workdir.mkdir(parents=True, exist_ok=True)
    main = ServerProcess(workdir / "main.log", "--kv-cache-memory", settings.kv_cache_memory, *MAIN_SERVER_FLAGS,
                         api_key=secrets.token_urlsafe(16), launcher=FAULT_INJECTION_LAUNCHER)
    try:
        load = run_load(main, MODEL, settings.clients, settings.load_requests)
        soak = run_soak(main, MODEL, settings.soak_requests, settings.soak_wave, settings.soak_concurrency)
        fault_results = [scenario(main, MODEL) for scenario in (
            faults.disconnect_mid_stream, faults.disconnect_before_first_token, faults.disconnect_during_prefill,
            faults.injected_request_fault, faults.injected_step_fault)]
    finally:
        main.stop()
    storm = ServerProcess(workdir / "storm.log", *STORM_SERVER_FLAGS)
    try:
        fault_results.append(faults.preemption_storm(storm, MODEL, settings.storm_requests))
    finally:
        storm.stop()
    fault_results.append(faults.sigterm_under_load(workdir / "sigterm.log", SIGTERM_SERVER_FLAGS, MODEL,
                                                   settings.sigterm_clients))
    fuzz_server = ServerProcess(workdir / "fuzz.log", *FUZZ_SERVER_FLAGS, api_key=secrets.token_urlsafe(16))
    try:
        fuzz = run_fuzz(fuzz_server.url, fuzz_server.headers, settings.fuzz_examples, seed=0, request_timeout=120)
        schema_fuzz = run_schemathesis(fuzz_server.url, fuzz_server.headers, settings.schemathesis_examples)
    finally:
        fuzz_server.stop()
    security = run_security_checks(workdir / "security")
    return SuiteReport(settings, load, soak, fault_results, fuzz, schema_fuzz, security)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small counts: the variant the tests run")
    defaults = SuiteSettings()
    for field in dataclasses.fields(SuiteSettings):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=str if field.type == "str" else int,
                            default=None, help=f"(default: {getattr(defaults, field.name)}, "
                                               f"--quick: {getattr(QUICK, field.name)})")
    parser.add_argument("--workdir", type=Path, default=None, help="where server logs go (default: a temp dir)")
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument("--simulate", type=int, default=None, metavar="N",
                        help="run only the model-free simulation: N requests through the real scheduler and KV "
                             "manager, checked at every idle point for leaks and inconsistencies (no server)")
    parser.add_argument("--simulate-seed", type=int, default=0, metavar="SEED",
                        help="the simulation's random seed (default: 0)")


def run_simulation(args: argparse.Namespace) -> None:
    from benchmarks.reliability.simulation import run_simulation as simulate
    from benchmarks.reliability.simulation_report import SimulationSettings

    if args.simulate < 1:
        raise SystemExit(f"--simulate needs a number of requests >= 1, got {args.simulate}")
    settings = SimulationSettings(requests=args.simulate, seed=args.simulate_seed)
    print(f"simulating {settings.requests:,} requests (seed {settings.seed}), no model", flush=True)
    report = simulate(settings, progress=lambda r: print(
        f"  {r.requests:,} requests, {r.steps:,} steps, {r.idle_points:,} idle points checked, "
        f"{r.num_problems} problems, {r.wall_seconds:.0f} s", flush=True))
    print(report.table())
    for problem in report.problems:
        print(f"PROBLEM: {problem}")
    if report.num_problems > len(report.problems):
        print(f"... and {report.num_problems - len(report.problems)} more problems")
    if args.output_json:
        summary = {name: value for name, value in vars(report).items()
                   if isinstance(value, (int, float, str, list)) and name != "heap_windows"}
        summary.update(aborts=dict(report.aborts), memory=[s._asdict() for s in report.memory],
                       heap_windows=[w._asdict() for w in report.heap_windows], table=report.table())
        args.output_json.write_text(json.dumps(summary, indent=2))
    sys.exit(1 if report.num_problems else 0)


def run(args: argparse.Namespace) -> None:
    if args.simulate is not None:
        run_simulation(args)
        return
    for name in ("httpx", "httpx2"):   # not one log line per request (httpx2: schemathesis' client)
        logging.getLogger(name).setLevel(logging.WARNING)
    base = QUICK if args.quick else SuiteSettings()
    settings = dataclasses.replace(base, **{field.name: getattr(args, field.name)
                                            for field in dataclasses.fields(SuiteSettings)
                                            if getattr(args, field.name) is not None})
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pagedllm-reliability-"))
    print(f"reliability suite {settings} (server logs in {workdir})", flush=True)
    report = run_suite(settings, workdir)
    print(report.table())
    problems = report.problems()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    if args.output_json:
        args.output_json.write_text(json.dumps(dataclasses.asdict(report), indent=2, default=str))
    sys.exit(1 if problems else 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability.suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(args)


if __name__ == "__main__":
    main()
