"""Throughput and latency against load: one placement replayed at several running batches.

A point at batch ``b`` is the plan's decision priced on the workload with ``b`` sequences (the
same ``build_problem``, schedule and predictions as any plan), with:

- ``decode_tokens_per_s = b / tpot_s`` (one token per running request per step);
- ``throughput_tokens_per_s = b * gen_len / (ttft_s + gen_len * tpot_s)`` (each request takes
  its prefill and then ``gen_len`` steps);
- ``arrival_rate_per_s = b / (ttft_s + gen_len * tpot_s)``: by Little's law, the rate of arrivals
  that keeps ``b`` requests in the system when each stays ``ttft_s + gen_len * tpot_s``;
- ``fits``: the placement's memory, with the KV of ``b`` full contexts, within both budgets;
- ``meets_slo``: ``tpot_s`` and ``ttft_s`` within the SLOs given (None: no limit).

A plan with a pipeline of several stages is replayed stage by stage (each stage's own decision
on its own device at ``b`` sequences) and link by link (the hidden state of ``b`` sequences over
the link's legs, ``sum(bytes / bytes_per_s + latency_s)``): ``ttft_s`` and ``tpot_s`` are every
stage and link in turn, ``fits`` every stage. With replicas, every point is one replica's: the
whole serves ``pipeline.replicas`` times its throughput and arrival rate.
"""

from __future__ import annotations

import dataclasses

from hetplan.evaluate import fits, make_plan
from hetplan.problem import build_problem
from hetplan.routing import routing_of_plan


def batches_up_to(max_batch: int) -> list:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch`` itself."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def meets(tpot_s: float, ttft_s: float, slo_tpot_s: float | None, slo_ttft_s: float | None) -> bool:
    return (slo_tpot_s is None or tpot_s <= slo_tpot_s) and (slo_ttft_s is None or ttft_s <= slo_ttft_s)


def point(batch: int, ttft_s: float, tpot_s: float, gen_len: int, fit: bool, slo: tuple) -> dict:
    """One point of the curve from a batch's predicted TTFT and TPOT (formulas in the module doc)."""
    request_s = ttft_s + gen_len * tpot_s
    return {"batch": batch, "ttft_s": ttft_s, "tpot_s": tpot_s, "decode_tokens_per_s": batch / tpot_s,
            "throughput_tokens_per_s": batch * gen_len / request_s, "arrival_rate_per_s": batch / request_s,
            "fits": fit, "meets_slo": meets(tpot_s, ttft_s, *slo)}


def curve(plan, batches: list, slo: tuple) -> list:
    """``plan``'s decision priced at each of ``batches`` -> points (see the module doc)."""
    stages = (plan.pipeline or {}).get("stages") or []
    at = _pipeline_at if len(stages) > 1 else _plan_at
    points = []
    for b in batches:
        ttft_s, tpot_s, fit = at(plan, dataclasses.replace(plan.workload, batch=b))
        points.append(point(b, ttft_s, tpot_s, plan.workload.gen_len, fit, slo))
    return points


def _plan_at(plan, wl) -> tuple:
    """(ttft_s, tpot_s, fits) of ``plan``'s decision on ``wl``."""
    at_b = make_plan(build_problem(plan.model, plan.hardware, wl, routing=routing_of_plan(plan)), plan.decision(),
                     plan.solver)
    return at_b.predicted["ttft_s"], at_b.predicted["tpot_s"], fits(at_b)


def _pipeline_at(plan, wl) -> tuple:
    """(ttft_s, tpot_s, fits) of ``plan``'s pipeline on ``wl``: each stage's decision replayed on
    its device, each link's legs carrying ``wl``'s hidden state."""
    from hetplan.pipeline.record import stage_plan, whole_model
    from hetplan.pipeline.stages import device_problem, hidden_bytes

    pp, spec = plan.pipeline, whole_model(plan)
    ttft_s = tpot_s = 0.0
    fit = True
    for i, st in enumerate(pp["stages"]):
        own = stage_plan(plan, i)
        first, end = st["layers"]
        problem = device_problem(spec, own.hardware, wl, first, end, pp.get("micro_batches") or 1)
        at_b = make_plan(problem, own.decision(), own.solver)
        ttft_s, tpot_s, fit = ttft_s + at_b.predicted["ttft_s"], tpot_s + at_b.predicted["tpot_s"], fit and fits(at_b)
    for link in pp["links"]:
        for phase in ("prefill", "decode"):
            nbytes = hidden_bytes(spec, wl, phase)
            s = link[f"{phase}_s"] if link.get("legs") is None else sum(   # an older plan: as recorded
                nbytes / leg["bytes_per_s"] + leg["latency_s"] for leg in link["legs"])
            ttft_s, tpot_s = (ttft_s + s, tpot_s) if phase == "prefill" else (ttft_s, tpot_s + s)
    return ttft_s, tpot_s, fit
