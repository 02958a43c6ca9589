"""Routing statistics of a mixture-of-experts model: how often each expert is chosen.

A run of ``hetplan exec --record-routing stats.json`` writes, and ``hetplan compile --routing
stats.json`` reads, one JSON object (keys sorted, one line per layer when pretty-printed)::

    {
      "model_fingerprint": "3f2a9c0d1b7e4a55",
      "tokens": 4096,
      "layers": {
        "3": [0.031, 0.250, ..., 0.012],
        "4": [...]
      }
    }

- ``model_fingerprint``: ``routing_fingerprint(spec)``, the model's ``ModelSpec.fingerprint()``
  with its weight and KV dtypes set aside (routing is a property of the weights' values and
  shapes, not of how they are stored, so statistics recorded from an fp32 run apply to a bf16
  plan of the same model).
- ``tokens`` (optional): how many tokens each layer routed while recording.
- ``layers``: MoE layer index (a decimal string) -> one fraction per routed expert: the share of
  tokens that chose expert ``e`` among their top-k. Each fraction lies in [0, 1] and a layer's
  fractions sum to ``experts_per_token`` (every token picks exactly k experts). A layer that is
  absent was not recorded; planners treat it as uniform (k / E per expert).

This module knows the file format and its validation; it knows nothing about torch, how
routing is computed, or how a planner uses the numbers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from hetplan.errors import HetplanError
from hetplan.files import parse_json, read_text
from hetplan.model import ModelSpec
from hetplan.plan import write_atomic
from hetplan.schema.errors import schema_error
from hetplan.schema.positions import json_line
from hetplan.schema.routing import Routing

SUM_TOLERANCE = 1e-3
"""How far a layer's fractions may sum from ``experts_per_token`` (relative to it): room for
the rounding of written fractions, nothing more."""

FRACTION_DIGITS = 8
"""Decimal digits a fraction is written with (keeps files byte-for-byte deterministic)."""


def routing_fingerprint(spec: ModelSpec) -> str:
    """The fingerprint routing statistics are keyed by: the spec's with dtypes set to fp32."""
    return dataclasses.replace(spec, weight_dtype="fp32", kv_dtype="fp32").fingerprint()


@dataclass(frozen=True)
class RoutingStats:
    model_fingerprint: str
    layers: dict
    """MoE layer index -> tuple of per-expert fractions of tokens (sum = experts_per_token)."""
    tokens: int | None = None
    """Tokens routed per layer while recording, when known."""

    def expert_fractions(self, l: int, spec: ModelSpec) -> tuple:
        """Fractions of layer ``l``'s tokens per expert; uniform (k / E) if ``l`` was not recorded."""
        if l in self.layers:
            return self.layers[l]
        return (spec.experts_per_token / spec.n_experts,) * spec.n_experts

    def ranked_experts(self, l: int, spec: ModelSpec) -> tuple:
        """Layer ``l``'s expert ids, most frequently chosen first (ties: lower id first)."""
        f = self.expert_fractions(l, spec)
        return tuple(sorted(range(len(f)), key=lambda e: (-f[e], e)))

    def to_json(self) -> str:
        doc = {"model_fingerprint": self.model_fingerprint,
               "layers": {str(l): [round(float(x), FRACTION_DIGITS) for x in fr]
                          for l, fr in sorted(self.layers.items())}}
        if self.tokens is not None:
            doc["tokens"] = self.tokens
        return json.dumps(doc, sort_keys=True, indent=1) + "\n"


def stats_from_counts(spec: ModelSpec, counts: dict, tokens: int) -> RoutingStats:
    """Build statistics from raw counts: ``counts[l][e]`` = tokens of layer ``l`` that chose
    expert ``e``; fraction = count / tokens."""
    if tokens <= 0:
        raise HetplanError("routing statistics: no tokens were routed; run at least one token "
                           "through the model before writing statistics")
    layers = {int(l): tuple(c / tokens for c in cs) for l, cs in counts.items()}
    stats = RoutingStats(routing_fingerprint(spec), layers, tokens)
    check_stats(stats, spec, source="recorded routing")
    return stats


def write_routing(path: str | Path, stats: RoutingStats) -> None:
    """Write ``stats`` to ``path`` atomically."""
    write_atomic(path, stats.to_json(), option="--record-routing")


def routing_of_plan(plan) -> RoutingStats | None:
    """The routing statistics a plan was compiled with (recorded in ``inputs.cli_args``)."""
    doc = plan.inputs.get("cli_args", {}).get("routing")
    return None if doc is None else stats_from_dict(doc, plan.model, source="plan inputs.cli_args.routing")


def load_routing(path: str | Path, spec: ModelSpec) -> RoutingStats:
    """Read and validate a routing-statistics file for ``spec`` (see the module docstring)."""
    p = Path(path)
    missing = f"routing-statistics file (write one with `hetplan exec PLAN --record-routing {p.name}`)"
    text = read_text(p, missing, "a JSON file")
    return stats_from_dict(parse_json(text, p), spec, source=str(p), text=text)


def stats_from_dict(doc, spec: ModelSpec, source: str = "routing statistics", text: str | None = None) -> RoutingStats:
    """Validate a parsed statistics document against the schema (``hetplan.schema.routing``) and
    ``spec``, and build RoutingStats; ``text`` (the file's JSON) gives errors their line."""
    if not isinstance(doc, dict):
        raise HetplanError(f"{source}: expected a JSON object with keys 'model_fingerprint' and "
                           f"'layers', got {type(doc).__name__}")
    try:
        valid = Routing.model_validate(doc)
    except ValidationError as e:
        raise schema_error(e, Routing, source, text, line_of=json_line,
                           fix=RECORD_FIX) from None
    stats = RoutingStats(valid.model_fingerprint, {int(k): tuple(v) for k, v in valid.layers.items()},
                         valid.tokens)
    check_stats(stats, spec, source)
    return stats


RECORD_FIX = "; record statistics with `hetplan exec PLAN --record-routing FILE`"


def check_stats(stats: RoutingStats, spec: ModelSpec, source: str) -> None:
    """Raise HetplanError unless ``stats`` fits ``spec``: same model, MoE layers only, one
    fraction per expert, each in [0, 1], each layer summing to ``experts_per_token``."""
    if not spec.is_moe:
        raise HetplanError(f"{source}: model {spec.name!r} has no experts; routing statistics "
                           f"apply only to mixture-of-experts models")
    expected = routing_fingerprint(spec)
    if stats.model_fingerprint != expected:
        raise HetplanError(f"{source}: recorded for model fingerprint {stats.model_fingerprint}, "
                           f"but {spec.name!r} has {expected}; record statistics for this model "
                           f"with `hetplan exec PLAN --record-routing FILE`")
    k = spec.experts_per_token
    for l, fractions in sorted(stats.layers.items()):
        where = f"{source}: layers.{l}"
        if not 0 <= l < spec.n_layers or not spec.is_moe_layer(l):
            moe_layers = f"{spec.first_dense_layers}..{spec.n_layers - 1}"
            raise HetplanError(f"{where}: not an MoE layer of {spec.name!r} (MoE layers: {moe_layers})")
        if len(fractions) != spec.n_experts:
            raise HetplanError(f"{where}: {len(fractions)} fractions, but the model has "
                               f"{spec.n_experts} experts per layer")
        for e, x in enumerate(fractions):
            if not 0.0 <= x <= 1.0:
                raise HetplanError(f"{where}[{e}]: fraction {x} is outside [0, 1]")
        total = sum(fractions)
        if abs(total - k) > SUM_TOLERANCE * k:
            raise HetplanError(f"{where}: fractions sum to {total:.6g}, expected "
                               f"{k} (experts_per_token): each token chooses exactly {k} experts")
