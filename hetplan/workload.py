"""Workload: what is asked of the machine (batch, prompt and generation lengths, objective)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.schema.fields import DIM_MAX

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
    prefill_chunk: int | None = None
    """Prompt tokens per sequence processed together in one prefill chunk (None: the whole
    prompt at once, what plans written before chunked prefill mean)."""

    def __post_init__(self):
        for key in ("batch", "prompt_len", "gen_len", "prefill_chunk"):
            v = getattr(self, key)
            if key == "prefill_chunk" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= DIM_MAX:  # plan.json's bound
                raise HetplanError(f"--{key.replace('_', '-')}: must be a positive integer, at most {DIM_MAX}, "
                                   f"got {v!r}")
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

    @property
    def chunk_len(self) -> int:
        """Tokens per sequence in one prefill chunk: min(prefill_chunk, prompt_len)."""
        return min(self.prefill_chunk or self.prompt_len, self.prompt_len)

    @property
    def n_chunks(self) -> int:
        """Prefill chunks: ceil(prompt_len / chunk_len)."""
        return -(-self.prompt_len // self.chunk_len)

    def chunks(self) -> tuple:
        """((start, length), ...) of each prefill chunk; the last one may be shorter."""
        c = self.chunk_len
        return tuple((s, min(c, self.prompt_len - s)) for s in range(0, self.prompt_len, c))

    def with_batch(self, batch: int) -> "Workload":
        return dataclasses.replace(self, batch=batch)

    def with_chunk(self, chunk: int | None) -> "Workload":
        return dataclasses.replace(self, prefill_chunk=chunk)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["prefill_chunk"] is None:
            d.pop("prefill_chunk")
        return d


def chunk_candidates(prompt_len: int) -> tuple:
    """Prefill chunk sizes the planner tries: 512, 1024, 2048, ... below the prompt, then the
    whole prompt."""
    out, c = [], 512
    while c < prompt_len:
        out.append(c)
        c *= 2
    return tuple(out) + (prompt_len,)
