"""Choose the serving plan: the running batch (and its placement) with the most throughput whose
predicted TPOT and TTFT meet the SLOs.

For each batch ``b`` in 1, 2, 4, ... up to ``--max-batch``, the model is compiled as any plan is
(``hetplan.compiler.compile_plan``, objective latency: TTFT + gen_len x TPOT at ``b`` sequences);
the search stops at the first batch that does not fit. Among the batches whose plan meets the
SLOs, the one with the most ``throughput_tokens_per_s`` wins (the smaller batch on a tie). Its
placement is replayed at every batch for the curve (``hetplan.serving.curve``) and the engine is
sized around it (``hetplan.serving.pools``). No batch meeting the SLOs is an error naming the SLO
and the value that would meet it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from hetplan.compiler import CompileRequest, CompileTime, compile_plan
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.serving.curve import batches_up_to, curve, meets
from hetplan.serving.pools import size_pools


@dataclass(frozen=True)
class ServingRequest:
    max_batch: int = 64
    """--max-batch: the most running requests considered."""
    max_context: int | None = None
    """--max-context: prompt + max_tokens of one request at most (None: prompt_len + gen_len)."""
    slo_tpot_s: float | None = None
    """--slo-tpot, in seconds (None: no limit)."""
    slo_ttft_s: float | None = None
    """--slo-ttft, in seconds (None: no limit)."""

    def __post_init__(self):
        if not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise HetplanError(f"--max-batch {self.max_batch}: must be at least 1")
        if self.max_context is not None and self.max_context < 1:
            raise HetplanError(f"--max-context {self.max_context}: must be at least 1")
        for flag, v in (("--slo-tpot", self.slo_tpot_s), ("--slo-ttft", self.slo_ttft_s)):
            if v is not None and not 0 < v < 1e9:  # also refuses nan and inf
                raise HetplanError(f"{flag} {v * 1e3:g}: must be a positive, finite number of milliseconds")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def slo_error(sreq: ServingRequest, plans: list) -> HetplanError:
    """The one-line error when no compiled batch meets the SLOs: which SLO, and what would."""
    fastest_tpot = min(plans, key=lambda p: p.predicted["tpot_s"])
    fastest_ttft = min(plans, key=lambda p: p.predicted["ttft_s"])
    t_tpot, t_ttft = fastest_tpot.predicted["tpot_s"], fastest_ttft.predicted["ttft_s"]
    if sreq.slo_tpot_s is not None and t_tpot > sreq.slo_tpot_s:
        return HetplanError(f"--slo-tpot {_ms(sreq.slo_tpot_s)} ms: no plan decodes that fast on this machine; the "
                            f"fastest (batch {fastest_tpot.workload.batch}) takes {_ms(t_tpot)} ms per token; pass "
                            f"--slo-tpot {_ms(t_tpot)} or more, or use a faster machine")
    if sreq.slo_ttft_s is not None and t_ttft > sreq.slo_ttft_s:
        return HetplanError(f"--slo-ttft {_ms(sreq.slo_ttft_s)} ms: no plan prefills the {fastest_ttft.workload.prompt_len}"
                            f"-token prompt that fast; the fastest (batch {fastest_ttft.workload.batch}) takes "
                            f"{_ms(t_ttft)} ms; pass --slo-ttft {_ms(t_ttft)} or more, or a shorter --prompt-len")
    within = [p for p in plans if p.predicted["tpot_s"] <= sreq.slo_tpot_s]
    best = min(within, key=lambda p: p.predicted["ttft_s"])
    return HetplanError(f"--slo-tpot {_ms(sreq.slo_tpot_s)} ms with --slo-ttft {_ms(sreq.slo_ttft_s)} ms: no batch "
                        f"meets both; within the TPOT SLO the fastest prefill takes {_ms(best.predicted['ttft_s'])} ms "
                        f"(batch {best.workload.batch}); pass --slo-ttft {_ms(best.predicted['ttft_s'])} or more")


def compile_serving(req: CompileRequest, sreq: ServingRequest):
    """-> (plan with ``serving`` set, CompileTime of every compile together)."""
    context = sreq.max_context or req.prompt_len + req.gen_len
    if context < req.prompt_len + req.gen_len:
        raise HetplanError(f"--max-context {context}: less than --prompt-len + --gen-len "
                           f"({req.prompt_len + req.gen_len}) that the plan is priced at; raise it or shorten those")
    wall0, cpu0 = time.perf_counter(), time.process_time()
    plans, solve_s = [], 0.0
    for b in batches_up_to(sreq.max_batch):
        one = dataclasses.replace(req, batch=b, objective="latency", notes=[])
        try:
            plan, took = compile_plan(one)
        except InfeasibleError:
            if not plans:
                raise
            break
        if not plans:
            req.notes.extend(one.notes)
        plans.append(plan)
        solve_s += took.solve_s
    if context > plans[0].model.max_positions:
        raise HetplanError(f"--max-context {context}: model {plans[0].model.name!r} has "
                           f"{plans[0].model.max_positions} positions; pass at most that")
    slo = (sreq.slo_tpot_s, sreq.slo_ttft_s)
    ok = [p for p in plans if meets(p.predicted["tpot_s"], p.predicted["ttft_s"], *slo)]
    if not ok:
        raise slo_error(sreq, plans)
    best = max(ok, key=lambda p: (p.predicted["throughput_tokens_per_s"], -p.workload.batch))
    pools = size_pools(best, sreq.max_batch, context)
    serving = {"max_batch": sreq.max_batch, "max_context": context,
               "slo": {"tpot_s": sreq.slo_tpot_s, "ttft_s": sreq.slo_ttft_s},
               "batch": min(best.workload.batch, pools["gpu_blocks"]), **pools,
               "curve": curve(best, batches_up_to(sreq.max_batch), slo)}
    plan = dataclasses.replace(best, serving=serving)
    return plan, CompileTime(time.perf_counter() - wall0, time.process_time() - cpu0, solve_s)
