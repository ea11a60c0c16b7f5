"""The simulation's traffic: random jobs (plain requests, n parallel samples, beam searches) with shared
prefixes, repeated prompts, cache salts, priorities and aborts, and the token ids that end them."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from benchmarks.reliability.simulation_report import Phase, SimulationSettings
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.request import Request
from pagedllm.sampling_params import SamplingParams

VOCAB = 32000
STOP = VOCAB       # the token that ends a plain or parallel sequence early (random ids stay below VOCAB)
EOS = VOCAB + 1    # a beam that picks it is complete
PARAMS = SamplingParams(temperature=0, stop_token_ids=[STOP])   # one shared instance


@dataclass(eq=False)
class Job:
    """One user request: a plain sequence, n parallel samples, or a beam search."""
    kind: str                         # "plain", "parallel" or "beam"
    prompt: list[int]
    max_tokens: int
    arrival: int                      # burst step at which it arrives
    abort_at: int | None
    abort_in_prefill: bool = False    # aborted at the first step that leaves it mid-prefill
    priority: int = 0
    salt: str | None = None
    width: int = 1                    # n, or the beam width
    live: list[Request] = field(default_factory=list)      # unfinished plain or parallel sequences
    pending: list[Request] = field(default_factory=list)   # parallel samples the scheduler has not forked yet
    search: BeamSearch | None = None                       # a beam job's search, which owns its beams

    def sequences(self) -> list[Request]:
        """Its unfinished sequences in the scheduler."""
        return [beam.request for beam in self.search.live] if self.search is not None else self.live


class Workload:
    """Random jobs: prompts built from shared prefixes (so full blocks repeat across requests), exact
    repeats of recent prompts (whole-prompt hits), random suffixes; mostly short outputs."""

    def __init__(self, rng: random.Random, settings: SimulationSettings):
        self.rng = rng
        self.settings = settings
        self.prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(8, 600))] for _ in range(48)]
        self.recent: list[list[int]] = []   # a small ring of recent prompts, emptied at each segment end

    def prompt(self, phase: Phase, storm: bool) -> list[int]:
        """Mostly a shared prefix and a short random suffix; in a storm, long and mostly unique, so
        that sharing cannot keep even the largest pool from filling up."""
        rng = self.rng
        limit = phase.max_model_len // (2 if storm else 4)
        roll = rng.random()
        if self.recent and roll < 0.08 and not storm:
            return list(rng.choice(self.recent))
        prompt = []
        if roll < (0.2 if storm else 0.6):   # a shared prefix, the popular ones far more often
            prefix = self.prefixes[int(len(self.prefixes) * rng.random() ** 2)]
            prompt = prefix[:rng.randint(limit // 4, limit)]
        random_ = rng.random
        suffix = rng.randint(limit // 2, limit) if storm else rng.randint(1, max(1, limit // 3))
        prompt += [int(random_() * VOCAB) for _ in range(suffix)]
        prompt = prompt[:phase.max_model_len - 1]
        if len(self.recent) < 16:
            self.recent.append(prompt)
        else:
            self.recent[rng.randrange(16)] = prompt
        return prompt

    def job(self, phase: Phase, arrival: int, storm: bool) -> Job:
        rng, settings = self.rng, self.settings
        prompt = self.prompt(phase, storm)
        room = phase.max_model_len - len(prompt)
        long = storm or rng.random() < 0.05
        max_tokens = rng.randint(1, max(1, room // 2) if long else min(room, 24))
        roll = rng.random()
        kind, width = "plain", 1
        if roll < settings.parallel_fraction:
            kind, width = "parallel", rng.randint(2, 4)
        elif roll < settings.parallel_fraction + settings.beam_fraction:
            kind, width = "beam", rng.randint(2, 4)
        abort_at, abort_in_prefill = None, False
        if rng.random() < settings.abort_fraction:   # early (waiting), mid-prefill if it ever is, or any time
            roll = rng.random()
            prefill = 1 + 2 * len(prompt) // phase.max_num_batched_tokens   # steps, with a shared budget
            abort_in_prefill = roll < 0.4   # and no timed abort: most prompts never are mid-prefill
            if not abort_in_prefill:
                abort_at = arrival + rng.randint(0, prefill if roll < 0.6 else 2 * (prefill + max_tokens))
        salt = f"tenant-{rng.randrange(4)}" if rng.random() < settings.salt_fraction else None
        return Job(kind, prompt, max_tokens, arrival, abort_at, abort_in_prefill,
                   priority=rng.randrange(4) if phase.policy == "priority" else 0, salt=salt, width=width)

