"""Workload: what is asked of the machine (batch, prompt and generation lengths, objective)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetplan.errors import HetplanError

OBJECTIVES = ("latency", "ttft", "tpot", "throughput")


@dataclass(frozen=True)
class Workload:
    batch: int = 1
    """Sequences decoded together."""
    prompt_len: int = 512
    """Prompt tokens per sequence (prefill)."""
    gen_len: int = 128
    """Generated tokens per sequence (decode steps)."""
    objective: str = "latency"
    """``latency`` = TTFT + gen_len * TPOT; ``ttft``; ``tpot``; ``throughput`` = tokens/s over
    an outer search on batch (``batch`` is then the largest batch tried)."""

    def __post_init__(self):
        for key in ("batch", "prompt_len", "gen_len"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise HetplanError(f"--{key.replace('_', '-')}: must be a positive integer, got {v!r}")
        if self.objective not in OBJECTIVES:
            raise HetplanError(f"--objective: {self.objective!r} is not one of {', '.join(OBJECTIVES)}")

    @property
    def context_len(self) -> int:
        """Tokens held in the KV cache at the end of generation (what memory is sized for)."""
        return self.prompt_len + self.gen_len

    @property
    def decode_context_len(self) -> float:
        """Mean context seen by one decode step: TTFT + gen_len * TPOT is exact for attention
        linear in context when TPOT is costed at this length."""
        return self.prompt_len + (self.gen_len + 1) / 2

    def with_batch(self, batch: int) -> "Workload":
        return dataclasses.replace(self, batch=batch)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
