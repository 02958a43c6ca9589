"""A request's sampling settings and the next token from its logits.

Greedy when ``temperature`` is 0; otherwise a draw from softmax(logits / temperature) restricted
to the smallest set of tokens whose probabilities sum to at least ``top_p`` (nucleus), from the
request's own generator (seeded by ``seed``, so a request's draws do not depend on what else is
running). Stop strings end the text at their first occurrence. Knows nothing about batching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.errors import HetplanError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = ()
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token, to ``max_tokens`` (load tests)."""

    def __post_init__(self):
        if self.max_tokens < 1:
            raise HetplanError(f"max_tokens {self.max_tokens}: generate at least one token")
        if self.temperature < 0:
            raise HetplanError(f"temperature {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise HetplanError(f"top_p {self.top_p}: must be in (0, 1]")
        if any(not s for s in self.stop):
            raise HetplanError("stop: a stop string is empty")

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token id from fp32 logits [V]."""
    if params.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / params.temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        keep = (sorted_p.cumsum(0) - sorted_p) < params.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


def cut_at_stop(text: str, stop: tuple) -> tuple[str, bool]:
    """(text up to the first stop string, whether one occurred)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


def safe_prefix(text: str, stop: tuple) -> str:
    """The part of ``text`` that no stop string can still turn out to start within: ``text``
    less its longest suffix that is a proper prefix of a stop string (streamed text holds it back)."""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[:len(text) - hold]
