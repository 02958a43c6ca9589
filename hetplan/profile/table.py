"""Measured per-op times (``node.profile.json``) and how the cost model reads them.

A profile table holds, per key (device, op, dtype, shape), the seconds one call took at several
sizes ``x``. ``x`` is the op's amount of work in its natural unit (``coordinate``): rows for the
linear stages and the embedding, causal query-key pairs (batch * P(P+1)/2) for prefill
attention, cached tokens read (batch * context) for decode attention. Each point also records
the FLOPs and bytes of the measured call, so that a shape that was not measured can borrow the
nearest measured one.

``ProfileTable.seconds(device, work, spec)`` answers the cost model:

1. the exact key: piecewise-linear interpolation of log t over log x between the two measured
   points around x; below the smallest point, that point's time (a call never gets cheaper
   than its fixed cost); above the largest, t = t_n * x / x_n (every op's work grows linearly
   in its coordinate, so its time does too once fixed costs are amortised);
2. otherwise the nearest measured shape of the same device, dtype and op family (the same op,
   then plain ``linear`` GEMMs for the linear stages), evaluated at x as above and scaled by
   max(flops / flops_e, bytes / bytes_e) of the query over that entry;
3. otherwise None: nothing relevant was measured and the analytic roofline applies.

Pure: knows nothing about torch or how points were measured (``hetplan.runtime.profiler``
measures them; ``hetplan.profile.trace`` folds a run's trace in; ``hetplan.profile.checks``
validates values and machines).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

from hetplan.cost import Work
from hetplan.dtypes import QUANTISED
from hetplan.errors import HetplanError
from hetplan.files import parse_json, read_text
from hetplan.model import ModelSpec

SCHEMA_VERSION = 1
DEVICES = ("cpu", "gpu")
LINEAR_STAGES = ("attn_in", "attn_out", "mlp", "moe", "head")
"""Stages made of weight GEMMs: without a measurement of their own they borrow ``linear`` ones."""
OPS = ("embed", "attention_prefill", "attention_decode", "linear") + LINEAR_STAGES


class ProfileMismatchWarning(UserWarning):
    """A profile measured on another machine than the one it is being used on."""


# -- keys ---------------------------------------------------------------------------------------

def table_dtype(spec: ModelSpec) -> str | None:
    """The dtype a profile key uses for ``spec``: its weight dtype, a quantised format included
    (``hetplan profile`` times the packed kernels of each); None for one the runtime has no
    kernels for."""
    return spec.weight_dtype if spec.weight_dtype in ("fp32", "bf16", "fp16") + QUANTISED else None


def arithmetic_dtype(device: str, dtype: str) -> str:
    """The dtype the runtime computes in for ``dtype`` weights on ``device``: a quantised format
    is dequantised into fp32 on the CPU, bf16 on a GPU (``hetplan.runtime.kernels.quant``).
    Attention and embedding of a quantised model run in it: the table's entries of that dtype
    price them when the quantised format has none of its own."""
    if dtype in QUANTISED:
        return "fp32" if device == "cpu" else "bf16"
    return dtype


def shape_key(op: str, spec: ModelSpec) -> str:
    """The weight or attention shape of ``op`` in ``spec``, as a table key (e.g. ``d768_f2048_silu_gated``)."""
    d = spec.hidden
    kv_dim = spec.n_kv_heads * spec.head_dim
    flags = ("_bias" if spec.attn_bias else "") + ("_qknorm" if spec.qk_norm else "")
    if op == "embed":
        return f"d{d}"
    if op == "attn_in":
        return f"d{d}_q{spec.q_dim}_kv{kv_dim}_{spec.norm}{flags}"
    if op == "attn_out":
        return f"o{spec.attn_out_dim}_d{d}" + ("_bias" if spec.attn_out_bias else "")
    if op == "mlp":
        return f"d{d}_f{spec.intermediate}_{spec.act}_{'gated' if spec.gated_mlp else 'plain'}"
    if op == "moe":
        return f"d{d}_e{spec.n_experts}k{spec.experts_per_token}_f{spec.moe_intermediate}"
    if op == "head":
        return f"d{d}_v{spec.vocab}"
    if op in ("attention_prefill", "attention_decode"):
        if spec.is_mla:
            return f"mla_h{spec.n_heads}_r{spec.kv_lora_rank}_rope{spec.qk_rope_head_dim}"
        return f"h{spec.n_heads}_kv{spec.n_kv_heads}_d{spec.head_dim}"
    raise HetplanError(f"profile: no shape key for op {op!r}; known ops: {', '.join(OPS)}")


def linear_shape(k: int, n: int) -> str:
    """Key of a plain GEMM ``[x, k] @ [k, n]`` (the standard grid)."""
    return f"{k}x{n}"


def coordinate(op: str, work: Work, spec: ModelSpec) -> float:
    """The size ``x`` a table interpolates in: causal pairs for prefill attention
    (flops / (4 * heads * head_dim)), cached tokens read for decode attention
    (bytes / kv_bytes_per_token), rows (``work.tokens``) for every other op."""
    if op == "attention_prefill":
        return work.flops / (4.0 * spec.n_heads * spec.head_dim)
    if op == "attention_decode":
        return work.bytes / spec.kv_bytes_per_token()
    return float(work.tokens)


# -- the table ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    x: float
    seconds: float
    """One task doing this op: the median call plus the runtime's per-task overhead
    (``measured``), or the median traced task (``trace``)."""
    spread_s: float = 0.0
    """Interquartile range of the repeats."""
    repeats: int = 1
    flops: float = 0.0
    bytes: float = 0.0
    source: str = "measured"
    """``measured`` (``hetplan profile``) or ``trace`` (folded in from a run)."""


@dataclass(frozen=True)
class Entry:
    device: str
    op: str
    dtype: str
    shape: str
    points: tuple
    """Points sorted by ``x``, one per ``x``."""

    @property
    def key(self) -> tuple:
        return (self.device, self.op, self.dtype, self.shape)

    def at(self, x: float, attr: str = "seconds") -> float:
        """``attr`` (seconds, flops or bytes) at ``x``: log-log interpolation inside the measured
        range, the first point's value below it, proportional to x above it."""
        xs = [p.x for p in self.points]
        first, last = self.points[0], self.points[-1]
        if x <= xs[0]:
            return getattr(first, attr)
        if x >= xs[-1]:
            return getattr(last, attr) * x / last.x
        i = bisect.bisect_right(xs, x)
        lo, hi = self.points[i - 1], self.points[i]
        a, b = getattr(lo, attr), getattr(hi, attr)
        f = math.log(x / lo.x) / math.log(hi.x / lo.x)
        if a <= 0 or b <= 0:
            return a + f * (b - a)
        return math.exp(math.log(a) + f * math.log(b / a))

    def with_point(self, p: Point) -> "Entry":
        """This entry with ``p`` added, replacing any point at the same ``x``."""
        kept = [q for q in self.points if not math.isclose(q.x, p.x, rel_tol=1e-9)]
        return dataclasses.replace(self, points=tuple(sorted(kept + [p], key=lambda q: q.x)))


@dataclass(frozen=True)
class ProfileTable:
    entries: dict
    """(device, op, dtype, shape) -> Entry."""
    machine: dict
    """Identity of the machine measured (``hetplan.profile.checks.current_machine``)."""
    transfers: dict
    """``h2d_pinned`` | ``h2d_pageable`` | ``d2h_pinned`` | ``d2h_pageable`` -> points over bytes
    (for reference: node.yaml's ``links`` and ``latency.link_task``, which the cost model reads,
    are taken from the pinned curves)."""
    info: dict
    """How it was measured: threads, torch version, budget and time taken, load average, the
    per-task overhead added to measured points, the peaks written to node.yaml, what was skipped."""

    def seconds(self, device: str, work: Work, spec: ModelSpec) -> float | None:
        """Measured seconds of ``work`` on ``device``, or None when nothing relevant was measured."""
        dtype = table_dtype(spec)
        if dtype is None or work.op not in OPS:
            return None
        if dtype in QUANTISED:
            self._require(device, dtype)
        x = coordinate(work.op, work, spec)
        arith = arithmetic_dtype(device, dtype)
        dtypes = (dtype,) if work.op in LINEAR_STAGES or arith == dtype else (dtype, arith)
        for dt in dtypes:
            exact = self.entries.get((device, work.op, dt, shape_key(work.op, spec)))
            if exact is not None:
                return exact.at(x)
        family = (work.op, "linear") if work.op in LINEAR_STAGES else (work.op,)
        for dt in dtypes:
            for op in family:
                near = self._nearest(device, op, dt, x, work)
                if near is not None:
                    return near.at(x) * _scale(work, near, x)
        return None

    @functools.cached_property
    def _measured(self) -> frozenset:
        """(device, op, dtype) of every entry."""
        return frozenset((d, o, t) for d, o, t, _ in self.entries)

    def _require(self, device: str, dtype: str) -> None:
        """A table that measured ``device`` must have measured the packed kernels of quantised
        ``dtype`` there too: pricing its weight GEMMs at another dtype's rate is what the table
        exists to avoid (a table that never measured ``device`` leaves it to the roofline)."""
        measured = self._measured
        if not any(d == device for d, _, _ in measured):
            return
        if not any((device, op, dtype) in measured for op in ("linear",) + LINEAR_STAGES):
            raise HetplanError(
                f"the node's profile has no measurement of {dtype} weights on the {device}: it was written "
                f"before `hetplan profile` timed packed kernels, or its budget ran out first; re-run "
                f"`hetplan profile --model MODEL --weight-dtype {dtype}` (or remove the node.yaml's "
                f"profile: key to price the plan analytically)")

    def _nearest(self, device: str, op: str, dtype: str, x: float, work: Work) -> Entry | None:
        """The entry of (device, op, dtype) whose bytes at ``x`` are closest to ``work.bytes``
        in ratio (ties: the smaller shape key)."""
        cands = [e for (d, o, t, _), e in sorted(self.entries.items()) if (d, o, t) == (device, op, dtype)]
        cands = [e for e in cands if e.at(x, "bytes") > 0 or e.at(x, "flops") > 0]
        if not cands:
            return None
        return min(cands, key=lambda e: abs(math.log(max(work.bytes, 1.0) / max(e.at(x, "bytes"), 1.0))))

    def with_entry(self, entry: Entry) -> "ProfileTable":
        return dataclasses.replace(self, entries={**self.entries, entry.key: entry})

    # -- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "machine": self.machine,
            "info": self.info,
            "entries": [{"device": e.device, "op": e.op, "dtype": e.dtype, "shape": e.shape,
                         "points": [dataclasses.asdict(p) for p in e.points]}
                        for _, e in sorted(self.entries.items())],
            "transfers": {k: [dataclasses.asdict(p) for p in v] for k, v in sorted(self.transfers.items())},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict, source: str = "node.profile.json", text: str | None = None) -> "ProfileTable":
        """Parse a profile, validated against ``hetplan.schema.profile`` (``text``, the file's
        JSON, gives errors their line)."""
        if not isinstance(d, dict) or d.get("schema_version") is None:
            raise HetplanError(f"{source}: not a hetplan profile (no schema_version); "
                               f"write one with `hetplan profile`")
        if d["schema_version"] != SCHEMA_VERSION:
            raise HetplanError(f"{source}: schema_version {d['schema_version']!r} is not the one this "
                               f"hetplan reads ({SCHEMA_VERSION}); re-run `hetplan profile`")
        _validate(d, source, text)
        try:
            entries = {}
            for i, e in enumerate(d.get("entries", [])):
                pts = tuple(sorted((Point(**p) for p in e["points"]), key=lambda p: p.x))
                if not pts:
                    raise ValueError(f"entries[{i}] has no points")
                entry = Entry(e["device"], e["op"], e["dtype"], e["shape"], pts)
                entries[entry.key] = entry
            transfers = {k: tuple(sorted((Point(**p) for p in v), key=lambda p: p.x))
                         for k, v in (d.get("transfers") or {}).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise HetplanError(f"{source}: malformed profile ({type(e).__name__}: {e}); "
                               f"re-run `hetplan profile`") from None
        return cls(entries=entries, machine=dict(d.get("machine") or {}), transfers=transfers,
                   info=dict(d.get("info") or {}))


def load_profile(path: str | Path, check_machine: bool = True) -> ProfileTable:
    """Read and validate a node.profile.json; refuse impossible values; warn (ProfileMismatchWarning)
    when it was measured on a machine other than this one."""
    from hetplan.profile.checks import current_machine, machine_differences, profile_problems

    p = Path(path)
    fix = "; re-run `hetplan profile`"
    text = read_text(p, "profile (the node.yaml's 'profile:' key points here); write it with "
                        "`hetplan profile --out NODE.yaml` or remove the key", "a JSON file", fix)
    table = ProfileTable.from_dict(parse_json(text, p, fix), source=str(p), text=text)
    problems = profile_problems(table)
    if problems:
        raise HetplanError(f"{p}: impossible values: " + "; ".join(problems) + "; re-run `hetplan profile`")
    if check_machine:
        diffs = machine_differences(table.machine, current_machine())
        if diffs:
            warnings.warn(ProfileMismatchWarning(
                f"{p} was measured on another machine ({'; '.join(diffs)}): its times may not hold here"),
                stacklevel=2)
    return table


def _validate(d: dict, source: str, text: str | None) -> None:
    """Refuse a profile that breaks the schema, in one line naming the file, line and key."""
    from hetplan.schema.errors import validate_json
    from hetplan.schema.profile import ProfileFile

    validate_json(ProfileFile, d, source, text, "a profile", "; re-run `hetplan profile`")


def _scale(work: Work, entry: Entry, x: float) -> float:
    """max(flops / flops_e, bytes / bytes_e) over the quantities the entry measured (> 0)."""
    ratios = [q / e for q, e in ((work.flops, entry.at(x, "flops")), (work.bytes, entry.at(x, "bytes"))) if e > 0]
    return max(ratios)
