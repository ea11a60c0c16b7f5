"""Acceptance counters, named as vLLM's spec-decode metrics: drafts, draft tokens, accepted tokens, and
accepted tokens per proposal position (position i is accepted only if 0..i-1 were)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int                  # k: proposals asked for per draft
    num_drafts: int = 0                   # speculative verifications (one per request and step)
    num_draft_tokens: int = 0             # proposals verified
    num_accepted_tokens: int = 0          # of those, accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification yields on average: the accepted proposals plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @classmethod
    def combined(cls, stats: list[SpecDecodingStats]) -> SpecDecodingStats | None:
        """Several engines' counters summed (data-parallel replicas); None when none speculates."""
        if not stats:
            return None
        total = cls(stats[0].num_spec_tokens)
        for part in stats:
            total.num_drafts += part.num_drafts
            total.num_draft_tokens += part.num_draft_tokens
            total.num_accepted_tokens += part.num_accepted_tokens
            total.num_accepted_tokens_per_pos = [a + b for a, b in zip(total.num_accepted_tokens_per_pos,
                                                                      part.num_accepted_tokens_per_pos)]
        return total

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
