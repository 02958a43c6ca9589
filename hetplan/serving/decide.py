"""Choose the serving plan: the replica count and running batch (and its placement) with the
most throughput whose predicted TPOT and TTFT meet the SLOs.

For each batch ``b`` in 1, 2, 4, ... up to ``--max-batch``, the model is compiled as any plan is
(``hetplan.compiler.compile_plan``, objective latency: TTFT + gen_len x TPOT at ``b`` sequences);
the search stops at the first batch that does not fit. On a machine of several devices (a node
with several GPUs, a cluster) the candidates are the whole machine (one pipeline) and each
replica count ``r`` that cuts it into alike groups (``hetplan.pipeline.replicas``), at every
batch: each replica is the pipeline (or the single device) planned on the first group, serving
its own requests. They are compiled best bound first (``ThroughputBound``: ``r x b x gen_len``
over the pipeline's lower bound on a replica's latency, no stage solved), and one whose bound
cannot beat a plan already found within the SLOs is not compiled: the choice is the one
compiling every candidate would make, in fewer compiles. A replica's TTFT and TPOT are its own
(a pipeline's: every stage and link in turn); the whole serves ``r`` times one replica's ``throughput_tokens_per_s`` (the replicas share nothing
the cost model prices but DRAM, which ``replicas_fit_dram`` checks). Among the (``r``, ``b``)
whose replica meets the SLOs, the most total throughput wins (fewer replicas, then the smaller
batch, on a tie). The winner's placement is replayed at every batch for the curve (one
replica's: ``hetplan.serving.curve``) and each replica's engine is sized around it
(``hetplan.serving.pools``; replicas on one node split its DRAM pool). No batch meeting the SLOs
is an error naming the SLO and the value that would meet it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from hetplan.compiler import CompileRequest, CompileTime, compile_plan, load_machine, parse_strategy, several_devices
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.pipeline.forked import cpu_seconds
from hetplan.pipeline.compile import BOUND_ROUNDING
from hetplan.pipeline.plan import Outclassed
from hetplan.pipeline.record import replicas_of
from hetplan.pipeline.replicas import replica_counts
from hetplan.pipeline.topology import Topology
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


def replica_times(plan) -> dict:
    """One replica's ``ttft_s``, ``tpot_s`` and ``throughput_tokens_per_s`` (``b x gen_len /
    (ttft + gen_len x tpot)``): the plan's own, or its pipeline's (every stage and link in turn)."""
    if plan.pipeline is None:
        return {k: plan.predicted[k] for k in ("ttft_s", "tpot_s", "throughput_tokens_per_s")}
    p, wl = plan.pipeline["predicted"], plan.workload
    return {"ttft_s": p["ttft_s"], "tpot_s": p["tpot_s"],
            "throughput_tokens_per_s": wl.batch * wl.gen_len / p["latency_s"]}


def slo_error(sreq: ServingRequest, plans: list) -> HetplanError:
    """The one-line error when no compiled batch meets the SLOs: which SLO, and what would."""
    def t(p, key):
        return replica_times(p)[key]
    fastest_tpot = min(plans, key=lambda p: t(p, "tpot_s"))
    fastest_ttft = min(plans, key=lambda p: t(p, "ttft_s"))
    t_tpot, t_ttft = t(fastest_tpot, "tpot_s"), t(fastest_ttft, "ttft_s")
    if sreq.slo_tpot_s is not None and t_tpot > sreq.slo_tpot_s:
        return HetplanError(f"--slo-tpot {_ms(sreq.slo_tpot_s)} ms: no plan decodes that fast on this machine; the "
                            f"fastest (batch {fastest_tpot.workload.batch}) takes {_ms(t_tpot)} ms per token; pass "
                            f"--slo-tpot {_ms(t_tpot)} or more, or use a faster machine")
    if sreq.slo_ttft_s is not None and t_ttft > sreq.slo_ttft_s:
        return HetplanError(f"--slo-ttft {_ms(sreq.slo_ttft_s)} ms: no plan prefills the {fastest_ttft.workload.prompt_len}"
                            f"-token prompt that fast; the fastest (batch {fastest_ttft.workload.batch}) takes "
                            f"{_ms(t_ttft)} ms; pass --slo-ttft {_ms(t_ttft)} or more, or a shorter --prompt-len")
    within = [p for p in plans if t(p, "tpot_s") <= sreq.slo_tpot_s]
    best = min(within, key=lambda p: t(p, "ttft_s"))
    return HetplanError(f"--slo-tpot {_ms(sreq.slo_tpot_s)} ms with --slo-ttft {_ms(sreq.slo_ttft_s)} ms: no batch "
                        f"meets both; within the TPOT SLO the fastest prefill takes {_ms(t(best, 'ttft_s'))} ms "
                        f"(batch {best.workload.batch}); pass --slo-ttft {_ms(t(best, 'ttft_s'))} or more")


def candidate(req: CompileRequest, r: int, b: int) -> CompileRequest:
    """The request compiling ``r`` replicas at batch ``b`` (each replica minimising its latency)."""
    return dataclasses.replace(req, batch=b, objective="latency", replicas=r, notes=[])


def replica_options(req: CompileRequest) -> list:
    """The replica counts the search weighs: 1 (one pipeline over the whole machine, or its one
    device), and on a machine planned over several devices every ``r`` that cuts it into alike
    groups (``replica_counts``)."""
    hw = load_machine(req)
    if not several_devices(hw, parse_strategy(req.strategy)[0]):
        return [1]
    return [1] + replica_counts(Topology.of(hw))


class ThroughputBound:
    """An upper bound on the throughput of ``r`` replicas at batch ``b``, no stage solved:
    ``r x b x gen_len`` over a lower bound on one replica's latency, the ``pipeline_lower_bound``
    of the model and group ``compile_plan`` would plan (``--weight-dtype auto`` resolved over the
    whole machine at that batch, as ``compile_pipeline`` resolves it)."""

    def __init__(self, req: CompileRequest, topo: Topology, memo: dict | None = None):
        from hetplan.compiler import load_inputs

        self.req, self.topo = req, topo
        self.spec = load_inputs(dataclasses.replace(req, notes=[]))[0]
        self._at = {}   # batch -> (model, workload): the same for every replica count
        self.memo = {} if memo is None else memo   # the candidates' stage memo (``_memos``'s keys)

    def __call__(self, r: int, b: int) -> float:
        """``r`` among ``replica_counts`` (a group exists), or 1."""
        from hetplan.pipeline.plan import pipeline_lower_bound, stage_bounds_memo
        from hetplan.pipeline.replicas import first_group

        spec, wl = self._model_at(b)
        group = self.topo if r == 1 else first_group(self.topo, r)
        # the groups of one machine share their devices' StageBounds, and the candidates' searches reuse them
        seconds = pipeline_lower_bound(spec, group, wl, "sum", stage_bounds_memo(self.memo, spec, wl))
        return r * b * wl.gen_len / seconds if seconds > 0 else math.inf

    def every(self, options: list, batches: list) -> dict:
        """{(r, b): ``self(r, b)``} for every replica count of ``options`` and batch of
        ``batches``, the batches bounded side by side (``forked_map``: each a pure function of the
        request); the StageBounds each built are kept in the memo as ``__call__`` keeps them."""
        from hetplan.pipeline.forked import forked_map
        from hetplan.pipeline.plan import stage_bounds_memo

        def at(b):
            return {r: self(r, b) for r in options}, self._model_at(b), \
                stage_bounds_memo(self.memo, *self._model_at(b))

        out = {}
        for b, (found, model_at, stage_bounds) in zip(batches, forked_map(at, batches)):
            self._at[b] = model_at
            stage_bounds_memo(self.memo, *model_at).update(stage_bounds)
            out.update({(r, b): found[r] for r in options})
        return out

    def _model_at(self, b: int) -> tuple:
        from hetplan.compiler import _workload
        from hetplan.pipeline.compile import fitting_dtype

        if b not in self._at:
            one = candidate(self.req, 1, b)
            wl = _workload(one)
            auto = self.req.weight_dtype == "auto"
            self._at[b] = (fitting_dtype(self.spec, self.topo, wl, one) if auto else self.spec), wl
        return self._at[b]


def _search(req: CompileRequest, sreq: ServingRequest) -> tuple:
    """Every (replica count, batch) worth compiling -> ({r: (plans by batch, first notes)},
    solve seconds). On one device, every batch up to the first that does not fit. Over several,
    the candidates in order of their ``ThroughputBound``, highest first; a candidate whose bound
    cannot beat the most throughput of a plan found within the SLOs is not compiled (nor is a
    batch as large as one that did not fit), and one compiled stops as soon as its pipeline
    search sees that it cannot (its latency ceiling, ``r b gen_len / best``: ``Outclassed``).
    InfeasibleError when nothing fits."""
    options, batches = replica_options(req), batches_up_to(sreq.max_batch)
    order = [(1, b) for b in batches]
    bound = {}
    memo: dict = {}   # stages bounded and priced by one candidate, for the others
    if len(options) > 1:
        upper = ThroughputBound(req, Topology.of(load_machine(req)), memo)
        bound = upper.every(options, batches)
        order = sorted(bound, key=lambda rb: (-bound[rb], rb))
    searches, solve_s, too_big, failure, best = {}, 0.0, {}, None, 0.0
    for r, b in order:
        if b >= too_big.get(r, math.inf) or bound.get((r, b), math.inf) * (1 + BOUND_ROUNDING) < best:
            continue
        one = dataclasses.replace(candidate(req, r, b), stage_memo=memo)
        if best > 0 and len(options) > 1:   # its pipeline search stops once it cannot beat ``best``
            one = dataclasses.replace(one, ceiling_s=r * b * req.gen_len / best * (1 + BOUND_ROUNDING))
        try:
            plan, took = compile_plan(one)
        except Outclassed:
            continue
        except InfeasibleError as e:
            too_big[r] = min(b, too_big.get(r, math.inf))
            if failure is None or r == 1:   # the whole machine's failure is the one to say
                failure = e
            continue
        plans, notes = searches.setdefault(r, ({}, {}))
        plans[b], notes[b] = plan, one.notes
        solve_s += took.solve_s
        t = replica_times(plan)
        if meets(t["tpot_s"], t["ttft_s"], sreq.slo_tpot_s, sreq.slo_ttft_s):
            best = max(best, r * t["throughput_tokens_per_s"])
    if not searches:
        raise failure
    found = {r: ([plans[b] for b in sorted(plans)], notes[min(notes)]) for r, (plans, notes) in searches.items()}
    return found, solve_s


def compile_serving(req: CompileRequest, sreq: ServingRequest):
    """-> (plan with ``serving`` set, CompileTime of every compile together)."""
    context = sreq.max_context or req.prompt_len + req.gen_len
    if context < req.prompt_len + req.gen_len:
        raise HetplanError(f"--max-context {context}: less than --prompt-len + --gen-len "
                           f"({req.prompt_len + req.gen_len}) that the plan is priced at; raise it or shorten those")
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    searches, solve_s = _search(req, sreq)
    plans = [p for found, _ in searches.values() for p in found]
    if context > plans[0].model.max_positions:
        raise HetplanError(f"--max-context {context}: model {plans[0].model.name!r} has "
                           f"{plans[0].model.max_positions} positions; pass at most that")
    slo = (sreq.slo_tpot_s, sreq.slo_ttft_s)
    ok = [p for p in plans if meets(*(replica_times(p)[k] for k in ("tpot_s", "ttft_s")), *slo)]
    if not ok:
        raise slo_error(sreq, plans)
    best = max(ok, key=lambda p: (replicas_of(p) * replica_times(p)["throughput_tokens_per_s"], -replicas_of(p),
                                  -p.workload.batch))
    req.notes.extend(searches[replicas_of(best)][1])
    pools = size_pools(best, sreq.max_batch, context, dram_sharers(best))
    serving = {"max_batch": sreq.max_batch, "max_context": context,
               "slo": {"tpot_s": sreq.slo_tpot_s, "ttft_s": sreq.slo_ttft_s},
               "batch": min(best.workload.batch, pools["gpu_blocks"]), **pools,
               "curve": curve(best, batches_up_to(sreq.max_batch), slo)}
    plan = dataclasses.replace(best, serving=serving)
    return plan, CompileTime(time.perf_counter() - wall0, cpu_seconds() - cpu0, solve_s)


def dram_sharers(plan) -> int:
    """Replicas sharing one node's DRAM: all of them when side by side on one node
    (``replica_step.gpus``), 1 when each has nodes of its own, or without replicas."""
    step = (plan.pipeline or {}).get("replica_step") or {}
    return replicas_of(plan) if "gpus" in step else 1
