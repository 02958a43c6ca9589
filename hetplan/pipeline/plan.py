"""The pipeline plan: stage boundaries chosen by ``hetplan.solvers.pipeline`` over stages
priced by the single-GPU planner, the links between them, and what the whole predicts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from hetplan.errors import HetplanError, InfeasibleError
from hetplan.model import ModelSpec
from hetplan.pipeline.bounds import StageBound
from hetplan.pipeline.record import stage_record
from hetplan.pipeline.stages import device_problem, hidden_bytes
from hetplan.pipeline.topology import Topology
from hetplan.workload import Workload


@dataclass(frozen=True)
class StagePlan:
    gpu: int | None
    """Index into its node's GPUs; None: the node's CPU (a node without a GPU)."""
    first_layer: int
    end_layer: int
    plan: object
    """The stage's single-device Plan (its layers numbered from 0)."""
    node: int = 0
    """Index into the topology's nodes (0 on a single node)."""

    @property
    def device(self) -> tuple:
        return self.node, self.gpu


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple
    links: tuple
    """Per consecutive pair: {from, to, from_node, to_node, kind, prefill_s, decode_s}."""
    workload: Workload
    objective: str
    """sum (latency: stages one after another) or max (throughput: the slowest stage)."""
    topology: Topology | None = None
    alone: tuple | None = None
    """(seconds, exact) of the best single device running the whole model, in the objective's
    seconds: its solved price when it could compete, else a lower bound; None: none fits."""
    model: ModelSpec | None = None
    """The whole model the stages cut (plan.json's ``pipeline.model``: a pipeline plan's main part
    is its first stage's layers alone)."""
    replicas: int = 1
    """Alike groups of devices each running these stages on sequences of their own
    (``hetplan.pipeline.replicas``); ``stages`` are the first group's."""
    micro_batches: int = 1
    """Micro-batches in flight, each with a KV cache of its own in every stage, for which the
    stages' KV caches are sized (``micro_batch_count``): 1 for the latency objectives (``sum``),
    one per stage for throughput (``max``)."""
    replica_step: dict | None = None
    """Where replica ``r`` runs (with ``replicas > 1``): ``{"gpus": q}``, its stages on GPU
    ``gpu + r q`` of the same node, or ``{"nodes": q}``, on node ``node + r q``, the same GPU."""

    def phase_s(self, phase: str) -> float:
        """One pass of ``phase`` through every stage and link in turn."""
        key = "ttft_s" if phase == "prefill" else "tpot_s"
        return sum(s.plan.predicted[key] for s in self.stages) + sum(l[f"{phase}_s"] for l in self.links)

    def bottleneck_s(self, phase: str) -> float:
        """The slowest stage or link of ``phase``: the interval between micro-batches."""
        key = "ttft_s" if phase == "prefill" else "tpot_s"
        return max([s.plan.predicted[key] for s in self.stages] + [l[f"{phase}_s"] for l in self.links])

    def predicted(self) -> dict:
        """A sequence's times, and the rates of every replica together (``replicas`` x one's)."""
        wl, r = self.workload, self.replicas
        ttft, tpot = self.phase_s("prefill"), self.phase_s("decode")
        return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": ttft + wl.gen_len * tpot,
                "decode_tokens_per_s": r * wl.batch / tpot,
                "prefill_tokens_per_s": r * wl.batch * wl.prompt_len / ttft,
                "pipelined_decode_tokens_per_s": r * wl.batch / self.bottleneck_s("decode")}

    def seconds_per_sequence(self) -> float:
        """``objective_s`` over the sequences every replica runs at once: what a throughput search
        over batch sizes and replica counts compares."""
        return self.objective_s() / (self.workload.batch * self.replicas)

    def objective_s(self) -> float:
        """The seconds the split minimised (as ``alone`` states them)."""
        if self.objective == "max":
            return self.bottleneck_s("decode")
        p = self.predicted()
        return {"ttft": p["ttft_s"], "tpot": p["tpot_s"]}.get(self.workload.objective, p["latency_s"])

    def to_dict(self) -> dict:
        """The stage assignment as plan.json's ``pipeline`` records it; a stage's and a link's
        node indices and the network only on a cluster, a stage's ``gpu`` only on a GPU."""
        topo = self.topology
        cluster = topo is not None and len(topo.nodes) > 1
        d = {"objective": self.objective,
             "stages": [_stage_dict(s, cluster) for s in self.stages],
             "links": [_link_dict(l, cluster) for l in self.links],
             "predicted": self.predicted()}
        if topo is not None:
            d["devices"] = len(topo.devices) * self.replicas
        d["micro_batches"] = self.micro_batches
        if self.replicas > 1:
            d["replicas"] = self.replicas
            d["replica_step"] = dict(self.replica_step)
        if topo is not None and topo.network is not None:
            d["network"] = {"name": topo.name, "bytes_per_s": topo.network.bytes_per_s,
                            "latency_s": topo.network.latency_s}
        if self.model is not None:
            d["model"] = self.model.to_dict()
        if self.alone is not None:
            d["single_device"] = {"objective_s": self.alone[0], "exact": self.alone[1],
                                  "pipeline_objective_s": self.objective_s() / self.replicas}
        return d


def _stage_dict(s: StagePlan, cluster: bool) -> dict:
    hw = s.plan.hardware
    d = {"device": (hw.gpus[0] if hw.gpus else hw.cpu).name, "layers": [s.first_layer, s.end_layer], "ttft_s": s.plan.predicted["ttft_s"],
         "tpot_s": s.plan.predicted["tpot_s"], "gpu_bytes": s.plan.memory["gpu_bytes"],
         "cpu_bytes": s.plan.memory["cpu_bytes"], "weights": _tiers(s.plan), "plan": stage_record(s.plan)}
    if s.gpu is not None:
        d["gpu"] = s.gpu
    if cluster:
        d["node"] = s.node
    return d


def _link_dict(l: dict, cluster: bool) -> dict:
    d = {"kind": l["kind"], "prefill_s": l["prefill_s"], "decode_s": l["decode_s"]}
    if l.get("legs") is not None:
        d["legs"] = [{"via": v, "bytes_per_s": r, "latency_s": t} for v, r, t in l["legs"]]
    for end in ("from", "to"):
        if l[end] is not None:
            d[f"{end}_gpu"] = l[end]
        if cluster:
            d[f"{end}_node"] = l[f"{end}_node"]
    return d


def _tiers(plan) -> dict:
    """Blocks per weights tier (gpu / stream / cpu) in a stage's plan, ends not held left out."""
    out = {"gpu": 0, "stream": 0, "cpu": 0}
    for p in plan.placement:
        if p["weight_bytes"] > 0:
            out[p["weights"]] += 1
    return out


def micro_batch_count(objective: str, n_stages: int) -> int:
    """Micro-batches a pipeline keeps in flight: one per stage under the throughput objective
    (``max``: every stage busy), 1 under the latency ones (``sum``: the stages take turns)."""
    return n_stages if objective == "max" else 1


class Outclassed(Exception):
    """A pipeline search stopped at its ceiling: every split of the model costs more
    (``seconds``, a lower bound, is above the ceiling). Not a user error: the caller weighing
    several searches (``compile --serve``) has a better plan already."""

    def __init__(self, seconds: float):
        super().__init__(f"every split costs at least {seconds:g} s")
        self.seconds = seconds


def plan_pipeline(spec: ModelSpec, hw, wl: Workload, solve_stage, objective: str = "sum",
                  ceiling: float = math.inf) -> PipelinePlan:
    """The best pipeline of ``spec`` over the devices of ``hw`` (a HardwareSpec: its GPUs; or a
    ``Topology``: every node's GPUs, or its CPU where it has none). ``solve_stage(problem)`` is
    the single-device planner: a Plan, or None when nothing fits. Stages are priced once per
    distinct (kind of device, layer count, holds embed, holds head, dense layers) and cached, and
    only where their cheap lower bound (``StageBound``) cannot rule them out; a stage's seconds
    are what the workload's objective minimises of it (``sum``), or its ``tpot_s`` (``max``).
    The split is optimal within ``solve_stage.gap`` (relative; 0 without it), the gap its
    prices are proven to (``best_split``'s ``gap``).

    KV caches: each stage holds one per micro-batch in flight (``micro_batch_count``). Under
    ``max`` that is the number of stages, which the split decides; the split is searched with
    every stage holding one cache per device (the most stages there can be), and when it uses
    ``S`` stages of ``D`` devices, its stages are planned again holding ``S`` caches (less
    memory: each still fits, and is at least as fast); a single device alone, priced with its
    one cache, is taken when it is as fast. A split of 2 to ``D - 1`` stages is so priced with
    more caches than it will hold, so the search may miss one that only fits, or is only
    faster, with its own count (never on two devices); the plan it returns is sized consistently."""
    from hetplan.pipeline.forked import forked_map
    from hetplan.solvers.ilp.counts import Envelope
    from hetplan.solvers.pipeline import TIE, best_split

    topo = Topology.of(hw)
    devices = topo.devices
    if not any(n.gpus for n in topo.nodes) and len(devices) == 1:
        raise HetplanError(f"node {topo.name!r} has no GPU: there is no pipeline to plan")
    L = spec.n_layers
    machines = [topo.device_hw(d) for d in devices]
    kind = [machines.index(m) for m in machines]  # equal devices share prices
    copies = micro_batch_count(objective, len(devices))
    key = _stage_key(spec, machines)
    plans, bounds, stage_bounds, learnt = _memos(solve_stage, spec, wl)
    relaxed: dict = {}   # stage key -> {configuration: its LP's value}, of the stages refined

    def solved(s, n_kv=None):   # the stage's plan (pure: it may run in a forked child)
        k, a, b = s
        n_kv = copies if n_kv is None else n_kv
        problem = device_problem(spec, machines[k], wl, a, b, n_kv)
        if n_kv != copies:
            return solve_stage(problem)
        f, m = family(key(*s)), b - a
        floors = {c: line.at_ms(m) for c, line in (learnt[f].lines or {}).items()} if f in learnt else {}
        # its LPs, solved when it was refined, else what its kind of stage learnt of them; its count
        # MILPs' lines, learnt from a stage of its kind
        known = relaxed.get(key(*s)) or {c: v for c, v in taught_lps(key(*s)).items() if v > -math.inf}
        given = {"lp_bounds": known, "floors": floors}
        return solve_stage(problem, **{k: v for k, v in given.items() if v})

    def stage_plan(k, a, b, n_kv=None):
        n_kv = copies if n_kv is None else n_kv
        if (key(k, a, b), n_kv) not in plans:
            plans[key(k, a, b), n_kv] = solved((k, a, b), n_kv)
        return plans[key(k, a, b), n_kv]

    seconds, lower, link = _pricing(spec, topo, wl, objective, machines, stage_bounds)
    cheap = getattr(solve_stage, "lower_bound", None)
    counted = getattr(solve_stage, "count_bounds", None)
    refines = cheap is not None and objective == "sum"   # the stage's objective is the DP's seconds only under ``sum``

    def family(at):   # the kind of stage of key ``at``: alike but for the layer count
        return at[:1] + at[2:]

    def taught(at):   # the bound of the stages of key ``at`` that its family's refinements and lines teach
        return learnt[family(at)].at(at[1]) if family(at) in learnt else -math.inf

    def taught_lps(at) -> dict:   # {(depth, slot): what its kind's other lengths taught of its LP at key ``at``}
        f = family(at)
        return {c: learnt[f].config_at(c, at[1]) for c in learnt[f].certs} if f in learnt else {}

    def lined(at) -> bool:   # whether the kind of stage of key ``at`` has its count MILPs' lines
        return family(at) in learnt and learnt[family(at)].lines is not None

    def refined(s):   # what refining stage ``s`` finds (pure: it may run in a forked child)
        k, a, b = s
        problem = device_problem(spec, machines[k], wl, a, b, copies)
        counts = counted(problem, taught_lps(key(*s))) if counted else None
        return counts if counts is not None else cheap(problem, lower(k, a, b))

    def learn(s, found) -> None:
        if isinstance(found, dict):   # every configuration's LP, each a bound on every length of this kind of stage
            for config, bound in found.items():
                learnt.setdefault(family(key(*s)), Envelope()).add(config, bound)
            relaxed[key(*s)] = {config: bound.value_s for config, bound in found.items() if bound.solved}
            found = min(bound.value_s for bound in found.values())
        bounds[key(*s)] = found

    def refine(k, a, b):
        if not refines:
            return None
        if lined(key(k, a, b)):   # its kind's lines bound it closer than its LPs would
            return taught(key(k, a, b))
        if key(k, a, b) not in bounds:
            learn((k, a, b), refined((k, a, b)))
        return bounds[key(k, a, b)]

    def line_job(job):   # the lines a priced stage asks for (pure: it may run in a forked child)
        (k, a, b), slopes = job
        return solve_stage.count_lines(device_problem(spec, machines[k], wl, a, b, copies), slopes, L)

    def slopes(s) -> dict:   # {(depth, slot): the slope of its LP} of each configuration of priced
        # stage ``s`` whose LP lies below its price: where its kind of stage needs a count MILP
        at = key(*s)
        if plans[at, copies] is None or at not in relaxed:
            return {}
        price = stage(*s)
        certs = learnt[family(at)].certs
        return {config: slope for config, value in relaxed[at].items() if value < price * (1 - TIE)
                and (slope := next((c.slope() for c in certs.get(config, []) if c.n == at[1]), None)) is not None}

    def prepare(stages, refining):   # the stages the search asks for next, side by side
        if refining:
            todo = [s for s in stages if refines and key(*s) not in bounds and not lined(key(*s))]
            for s, found in zip(todo, forked_map(refined, todo)):
                learn(s, found)
            return
        todo = [s for s in stages if (key(*s), copies) not in plans]
        for s, plan in zip(todo, forked_map(solved, todo)):
            plans[key(*s), copies] = plan
        if getattr(solve_stage, "count_lines", None) is None:
            return
        jobs = {}   # the first stage priced of each kind: the lines of its count MILPs
        for s in todo:
            if not lined(key(*s)) and family(key(*s)) not in jobs and (found := slopes(s)):
                jobs[family(key(*s))] = (s, found)
        for f, found in zip(jobs, forked_map(line_job, list(jobs.values()))):
            learnt[f].add_lines(found)


    def stage(k, a, b, n_kv=None):
        p = stage_plan(k, a, b, n_kv)
        return math.inf if p is None else seconds(p.predicted["ttft_s"], p.predicted["tpot_s"])

    split = best_split(L, len(devices), stage, link, objective, lower, key, ceiling=ceiling, refine=refine,
                       learnt=taught if counted is not None else None, prepare=prepare,
                       gap=getattr(solve_stage, "gap", 0.0))
    if split is not None and split.outclassed:
        raise Outclassed(split.cost_s)
    if split is None:
        raise InfeasibleError(f"{spec.name}: no split of its {L} layers over the {len(devices)} devices of "
                              f"{topo.name!r} fits (each stage's GPU, with its host's DRAM)")
    alone = {k: c for k in sorted(set(kind)) if (c := _alone(k, lambda *s: stage(*s, 1), lower, L, split.cost_s))}
    pp = _sized(spec, topo, wl, objective, split.stages, stage_plan, min(alone.values()) if alone else None)
    if objective == "max" and len(pp.stages) > 1:   # one device alone holds one KV cache, not one per device
        k, (best_s, exact) = min(alone.items(), key=lambda kc: kc[1], default=(None, (math.inf, False)))
        if exact and best_s <= pp.objective_s() * (1 + 1e-12):
            pp = _sized(spec, topo, wl, objective, ((k, 0, L),), stage_plan, alone[k])
    check_dram(spec, topo, pp.stages)
    return pp


def pipeline_lower_bound(spec: ModelSpec, hw, wl: Workload, objective: str = "sum",
                         stage_bounds: dict | None = None) -> float:
    """A lower bound on ``objective_s`` of the pipeline ``plan_pipeline`` returns for the same
    arguments, whatever its split, KV copies or single device alone, with no stage solved: the
    stage DP over the stages' lower bounds (``StageBound``, ``split_lower_bound``).
    ``stage_bounds``: the ``StageBound`` of each device description for this model and workload,
    kept for the next call (a caller bounding several device groups of one machine; None: this
    call's own)."""
    from hetplan.solvers.pipeline import split_lower_bound

    topo = Topology.of(hw)
    machines = [topo.device_hw(d) for d in topo.devices]
    _, lower, link = _pricing(spec, topo, wl, objective, machines, {} if stage_bounds is None else stage_bounds)
    return split_lower_bound(spec.n_layers, len(machines), link, objective, lower, _stage_key(spec, machines))


def _memos(solve_stage, spec: ModelSpec, wl: Workload) -> tuple:
    """(plans, refined bounds) of stages, by stage key (``_stage_key``), the ``StageBound`` of
    each device description, and what each kind of stage (its key without the layer count)
    learnt of every length of it (an ``Envelope``: its ``CountBound``s and its count MILPs'
    lines): dicts of this search alone, or, where ``solve_stage`` carries a
    ``memo`` (``stage_solver``'s, shared by the candidates of one ``compile --serve``), its
    entries for this model and workload (the StageBounds in its ``shared_memo``, which every
    strategy and ``ThroughputBound`` read: they bound any plan)."""
    memo = getattr(solve_stage, "memo", None)
    if memo is None:
        return {}, {}, {}, {}
    scope = (json.dumps(spec.to_dict(), sort_keys=True), wl)
    return (memo.setdefault(("plans", *scope), {}), memo.setdefault(("bounds", *scope), {}),
            stage_bounds_memo(getattr(solve_stage, "shared_memo", memo), spec, wl),
            memo.setdefault(("counts", *scope), {}))


def stage_bounds_memo(memo: dict, spec: ModelSpec, wl: Workload) -> dict:
    """``memo``'s ``StageBound`` per device description for this model and workload (the
    ``stage_bounds`` of ``pipeline_lower_bound``)."""
    return memo.setdefault(("stage_bounds", json.dumps(spec.to_dict(), sort_keys=True), wl), {})


def _described(machines: list) -> list:
    """Each device as described (its machine's JSON): what equal devices share, in a key."""
    return [json.dumps(m.to_dict(), sort_keys=True) for m in machines]


def _stage_key(spec: ModelSpec, machines: list):
    """``key(k, a, b)`` of the stage DP: stages with equal keys cost the same (the same device, as
    described, as many layers, holding the embedding or the head alike, as many dense layers)."""
    L = spec.n_layers
    device = _described(machines)

    def key(k, a, b):
        return device[k], b - a, a == 0, b == L, min(b - a, max(0, spec.first_dense_layers - a))
    return key


def _pricing(spec: ModelSpec, topo: Topology, wl: Workload, objective: str, machines: list,
             bounds: dict) -> tuple:
    """(seconds, lower, link) of the stage DP: ``seconds(ttft, tpot)``, what the objective
    minimises of a stage or a link (the throughput objective: its decode time, the interval the
    slowest one sets); ``lower(k, a, b)``, a lower bound on the seconds of layers ``[a, b)`` on
    device ``k`` (one ``StageBound`` per device description, kept in ``bounds``: built once for
    the model and workload); ``link(j, k)``, the hop's seconds."""
    devices = topo.devices
    described = _described(machines)

    def seconds(pred_ttft: float, pred_tpot: float) -> float:
        if objective == "max":
            return pred_tpot
        return {"ttft": pred_ttft, "tpot": pred_tpot}.get(wl.objective, pred_ttft + wl.gen_len * pred_tpot)

    def lower(k, a, b):
        if described[k] not in bounds:
            bounds[described[k]] = StageBound(spec, machines[k], wl)
        return seconds(*bounds[described[k]](a, b))

    def link(j, k):
        return seconds(*(topo.hop(devices[j], devices[k], hidden_bytes(spec, wl, ph))[1]
                         for ph in ("prefill", "decode")))

    return seconds, lower, link


def _sized(spec, topo, wl, objective, split, stage_plan, alone) -> PipelinePlan:
    """The pipeline of ``split`` ((device, first, end) per stage), each stage holding one KV
    cache per micro-batch it keeps in flight (``micro_batch_count``)."""
    m = micro_batch_count(objective, len(split))
    devices = topo.devices
    stages = []
    for k, a, b in split:
        p = stage_plan(k, a, b, m)
        if p is None:
            raise InfeasibleError(f"{spec.name}: layers {a}-{b - 1} on {topo.device_name(devices[k])} do not fit "
                                  f"with {m} KV cache(s), one per micro-batch in flight")
        stages.append(StagePlan(devices[k][1], a, b, p, devices[k][0]))
    return PipelinePlan(tuple(stages), _links(topo, spec, wl, stages), wl, objective, topo, alone, spec,
                        micro_batches=m)


def fixed_pipeline(spec: ModelSpec, hw, wl: Workload, split: tuple, solve_stage, objective: str = "sum"):
    """The pipeline of a given split ((device index, first, end) per stage), each stage planned by
    ``solve_stage``; None when a stage does not fit."""
    topo = Topology.of(hw)
    devices = topo.devices
    m = micro_batch_count(objective, len(split))
    stages = []
    for k, a, b in split:
        p = solve_stage(device_problem(spec, topo.device_hw(devices[k]), wl, a, b, m))
        if p is None:
            return None
        stages.append(StagePlan(devices[k][1], a, b, p, devices[k][0]))
    return PipelinePlan(tuple(stages), _links(topo, spec, wl, stages), wl, objective, topo, model=spec,
                        micro_batches=m)


def llama_cpp_split(spec: ModelSpec, hw) -> tuple:
    """llama.cpp's ``--split-mode layer`` split of ``spec`` over ``hw``'s devices (by free memory)."""
    from hetplan.solvers.split_mode import layer_stages

    topo = Topology.of(hw)
    machines = [topo.device_hw(d) for d in topo.devices]
    return layer_stages(spec.n_layers, [m.gpu_budget_bytes() if m.gpus else m.cpu_budget_bytes() for m in machines])


def _links(topo: Topology, spec: ModelSpec, wl: Workload, stages) -> tuple:
    def hop(s, t, phase):
        return topo.hop(s.device, t.device, hidden_bytes(spec, wl, phase))
    return tuple({"from": s.gpu, "to": t.gpu, "from_node": s.node, "to_node": t.node,
                  "kind": hop(s, t, "decode")[0], "prefill_s": hop(s, t, "prefill")[1],
                  "decode_s": hop(s, t, "decode")[1], "legs": topo.legs(s.device, t.device)}
                 for s, t in zip(stages, stages[1:]))


def check_dram(spec: ModelSpec, topo: Topology, stages) -> None:
    """Each node's stages together must fit in its DRAM budget."""
    for n, node in enumerate(topo.nodes):
        cpu = sum(s.plan.memory["cpu_bytes"] for s in stages if s.node == n)
        if cpu > node.cpu_budget_bytes():
            from hetplan.units import format_bytes
            raise InfeasibleError(f"{spec.name}: the best split's stages on node {node.name!r} hold "
                                  f"{format_bytes(cpu)} in DRAM together, more than the "
                                  f"{format_bytes(node.cpu_budget_bytes())} it has free; use a smaller "
                                  f"--weight-dtype or a node with more DRAM")


def _alone(k: int, stage, lower, L: int, best_s: float):
    """(seconds, exact) of the whole model on device ``k`` alone: its price when the DP priced
    it or it can beat ``best_s``, else its lower bound (no solve); None when it does not fit."""
    bound = lower(k, 0, L)
    if bound == math.inf:   # (the bound is inf only where nothing fits)
        return None
    exact = stage(k, 0, L) if bound <= best_s * (1 + 1e-9) else None  # a bound as tight as the price
    if exact is not None:
        return None if exact == math.inf else (exact, True)
    return (bound, False)


def pipeline_makespan_s(times: list, n_micro: int) -> float:
    """Replay ``n_micro`` micro-batches through a chain of serial resources (stage, link, stage,
    ...) taking ``times[s]`` each: micro-batch ``i`` leaves resource ``s`` at
    ``F[i][s] = max(F[i-1][s], F[i][s-1]) + times[s]``; the makespan is ``F[n_micro-1][-1]``."""
    done = [0.0] * len(times)
    for _ in range(n_micro):
        ready = 0.0
        for s, t in enumerate(times):
            done[s] = max(done[s], ready) + t
            ready = done[s]
    return done[-1]
