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
    dec, routing = plan.decision(), routing_of_plan(plan)
    points = []
    for b in batches:
        wl = dataclasses.replace(plan.workload, batch=b)
        at_b = make_plan(build_problem(plan.model, plan.hardware, wl, routing=routing), dec, plan.solver)
        p = at_b.predicted
        points.append(point(b, p["ttft_s"], p["tpot_s"], wl.gen_len, fits(at_b), slo))
    return points
