"""Compiling for several devices: a node with several GPUs, or a cluster.

The pipeline is the plan: ``plan_pipeline`` chooses the stages, each solved by the single-device
ILP. plan.json's main part (model, hardware, placement, schedule, predicted) is the **first
stage's own plan** (its layers as a model of their own, its device alone), so that every tool
reading one plan reads a real one; ``pipeline`` holds the whole and what it predicts. The whole
model is never solved on one GPU unless that could compete (a lower bound rules it out
otherwise), so a model that fits only across the GPUs compiles, and so does a large one fast.
Also ``--gpu-mem`` per GPU. Knows nothing about torch.
"""

from __future__ import annotations

import dataclasses
import math

from hetplan import progress
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.hardware import HardwareSpec
from hetplan.pipeline.plan import (PipelinePlan, fixed_pipeline, llama_cpp_split, pipeline_lower_bound,
                                   plan_pipeline)
from hetplan.pipeline.topology import Topology
from hetplan.problem import build_problem
from hetplan.units import format_bytes, parse_bytes


def with_gpu_budgets(hw, text: str | None, cpu_mem: int | None = None):
    """``--gpu-mem``: ``SIZE`` for every GPU, or ``K=SIZE,...`` per GPU index (``N.K=SIZE`` on a
    cluster: GPU K of node N); ``--cpu-mem`` (bytes) for every node's DRAM."""
    topo = Topology.of(hw)
    budgets: dict = {}
    if text:
        for part in text.split(","):
            where, eq, size = part.strip().rpartition("=")
            key = _gpu_key(where.strip(), topo, text) if eq else None
            value = parse_bytes(size.strip(), "--gpu-mem")
            for n, g in ([key] if key else [(n, g) for n, g in topo.devices if g is not None]):
                budgets[n, g] = value
        if not budgets:
            raise HetplanError(f"--gpu-mem {text}: {topo.name!r} has no GPU; drop --gpu-mem")
    nodes = []
    for n, node in enumerate(topo.nodes):
        gpus = list(node.gpus)
        for (m, g), value in budgets.items():
            if m == n:
                if value > gpus[g].memory_bytes:
                    raise HetplanError(f"--gpu-mem {text}: {format_bytes(value)} for GPU {g} of {node.name!r} is "
                                       f"more than its {gpus[g].name} has ({format_bytes(gpus[g].memory_bytes)}); "
                                       f"give at most that")
                gpus[g] = dataclasses.replace(gpus[g], memory_bytes=value + node.gpu_reserve_bytes)
        node = dataclasses.replace(node, gpus=tuple(gpus))
        if cpu_mem is not None:
            node = node.with_budgets(cpu_mem=cpu_mem)
        nodes.append(node)
    return nodes[0] if isinstance(hw, HardwareSpec) else dataclasses.replace(topo, nodes=tuple(nodes))


def _gpu_key(where: str, topo: Topology, text: str) -> tuple:
    """``K`` (a GPU of a single node) or ``N.K`` (GPU K of node N) -> (node, gpu)."""
    parts = where.split(".")
    if not all(p.isdigit() for p in parts) or len(parts) != (2 if len(topo.nodes) > 1 else 1):
        form = "N.K=SIZE (GPU K of node N)" if len(topo.nodes) > 1 else "K=SIZE (GPU K)"
        raise HetplanError(f"--gpu-mem {text}: cannot read {where!r} as a GPU; write SIZE for every GPU or "
                           f"{form}, comma-separated, e.g. --gpu-mem "
                           f"{'0.0=20GiB,1.0=22GiB' if len(topo.nodes) > 1 else '0=20GiB,1=22GiB'}")
    n, g = (int(parts[0]), int(parts[1])) if len(parts) == 2 else (0, int(parts[0]))
    if n >= len(topo.nodes) or g >= len(topo.nodes[n].gpus):
        where_n = f"node {n} of " if len(topo.nodes) > 1 else ""
        raise HetplanError(f"--gpu-mem {text}: there is no GPU {g} on {where_n}{topo.name!r} "
                           f"({', '.join(topo.device_name(d) for d in topo.devices)}); fix the index")
    return n, g


def fitting_dtype(spec, topo: Topology, wl, req):
    """``--weight-dtype auto`` over all devices: the checkpoint's dtype, else the widest of
    ``AUTO_DTYPES`` whose weights, KV and one workspace fit in every GPU and DRAM together."""
    from hetplan.compiler import AUTO_DTYPES

    total = sum(sum(max(0, g.memory_bytes - n.gpu_reserve_bytes) for g in n.gpus) + n.cpu_budget_bytes()
                for n in topo.nodes)
    cand = spec
    for dtype in (spec.weight_dtype,) + AUTO_DTYPES:
        cand = spec.with_dtypes(weight_dtype=dtype, kv_dtype=req.kv_dtype or spec.kv_dtype)
        problem = build_problem(cand, topo.device_hw(topo.devices[0]), wl)
        need = sum(b.weight_bytes + b.kv_bytes for b in problem.blocks)
        if need <= total:
            if dtype != spec.weight_dtype:
                req.notes.append(f"weights do not fit in {spec.weight_dtype} on all devices together; planning "
                                 f"{dtype} (pass --weight-dtype to choose)")
            return cand
    return cand


def compile_pipeline(spec, hw, req, routing=None):
    """The pipeline plan of ``spec`` over ``hw`` (a node with several GPUs, or a Topology) ->
    (Plan whose main part is the first stage's, solve seconds)."""
    from hetplan.compiler import _workload, stage_solver

    topo = Topology.of(hw)
    if routing is not None:
        req.notes.append("--routing: the pipeline's stages are priced under uniform routing (per-stage "
                         "routing statistics are not planned yet)")
    if req.weight_dtype == "auto":
        spec = fitting_dtype(spec, topo, _workload(req), req)
    objective = "max" if req.objective == "throughput" else "sum"
    batches = [1 << i for i in range(req.batch.bit_length()) if 1 << i <= req.batch] \
        if req.objective == "throughput" else [req.batch]
    solve = stage_solver(req, moe_stages=True)
    ceiling = math.inf if req.ceiling_s is None else req.ceiling_s
    if req.replicas > 1:   # the replica count given (``compile --serve`` weighs each): one batch, no search
        best = replicated(spec, topo, req.replicas, _workload(req), solve, objective, ceiling)
    else:
        best, failure = best_batch(spec, topo, req, batches, solve, objective, ceiling)
        if best is not None and objective == "max":
            best = best_replicas(spec, topo, best, solve)
        if best is None:
            raise failure
    _note(best, topo, req)
    record = best.to_dict()
    with progress.step("pricing llama.cpp's --split-mode layer over the same devices"):
        record["baselines"] = {LLAMA_CPP: llama_cpp_baseline(spec, topo, best.workload, req, objective)}
    first = best.stages[0].plan
    inputs = {"model_source": req.model, "hw_source": req.hw, "cli_args": req.cli_args(routing)}
    solve_s = sum(s.plan.solver.get("solve_seconds", 0.0) for s in best.stages)
    return dataclasses.replace(first, inputs=inputs, pipeline=record), solve_s


def best_batch(spec, topo: Topology, req, batches: list, solve, objective: str, ceiling: float = math.inf) -> tuple:
    """(the pipeline of the batch in ``batches`` with the fewest seconds per sequence, the smallest
    of equals, or None; the InfeasibleError of the smallest batch that did not fit, or None).
    The largest batch is planned first; a smaller one whose pipeline cannot beat the best so far,
    by its lower bound (``pipeline_lower_bound``), is not solved. A batch that does not fit
    leaves the smaller ones to try (a larger one would not fit either: its KV caches are larger).
    ``ceiling``: ``plan_pipeline``'s (Outclassed)."""
    from hetplan.compiler import _workload

    best, failure = None, None
    for batch in sorted(batches, reverse=True):
        wl = _workload(req, batch)
        if best is not None and len(batches) > 1:
            bound = pipeline_lower_bound(spec, topo, wl, objective) / batch
            if bound > best.seconds_per_sequence() * (1 + BOUND_ROUNDING):
                continue
        with progress.step(f"choosing pipeline stages over the {len(topo.devices)} devices of {topo.name!r}"
                           + (f" (batch {batch})" if len(batches) > 1 else "")):
            try:
                pp = plan_pipeline(spec, topo, wl, solve, objective, ceiling)
            except InfeasibleError as e:
                failure = e
                continue
        if best is None or pp.seconds_per_sequence() <= best.seconds_per_sequence():
            best = pp
    return best, failure


def best_replicas(spec, topo: Topology, best: PipelinePlan, solve) -> PipelinePlan:
    """The throughput objective: ``best`` (one pipeline over every device), or ``r`` replicas of
    a pipeline over ``devices / r`` alike devices each where they serve more sequences a second
    (``hetplan.pipeline.replicas``), at the same batch per replica. A replica count whose group's
    pipeline cannot serve more, by its lower bound (``pipeline_lower_bound``), is not solved: it
    would not be taken (only a strictly better one replaces ``best``)."""
    from hetplan.pipeline.replicas import first_group, replica_counts

    for r in replica_counts(topo):
        group = first_group(topo, r)
        bound = pipeline_lower_bound(spec, group, best.workload, "max") / (best.workload.batch * r)
        if bound > best.seconds_per_sequence() * (1 + BOUND_ROUNDING):
            continue
        try:
            pp = replicated(spec, topo, r, best.workload, solve)
        except InfeasibleError:
            continue  # fewer devices hold less: fewer replicas may still fit
        if pp.seconds_per_sequence() < best.seconds_per_sequence():
            best = pp
    return best


BOUND_ROUNDING = 1e-9
"""Relative slack on a lower bound before it rules a candidate out: a bound summed in another
order than the price it bounds may round a few ulps above it."""


def replicated(spec, topo: Topology, r: int, wl, solve, objective: str = "max",
               ceiling: float = math.inf) -> PipelinePlan:
    """``r`` replicas of the best pipeline (``objective``: ``max``, throughput; ``sum``, latency,
    what each replica of a serving plan minimises) over the first of ``r`` alike groups of
    ``topo``'s devices (``hetplan.pipeline.replicas``); InfeasibleError when the devices do not
    cut into ``r`` alike groups, a group holds no pipeline, or the replicas' DRAM does not fit;
    ``ceiling``: ``plan_pipeline``'s, for one replica (Outclassed)."""
    from hetplan.pipeline.replicas import first_group, replica_step, replicas_fit_dram, replicas_may_fit_dram

    group = first_group(topo, r)
    if group is None:
        raise InfeasibleError(f"the devices of {topo.name!r} do not cut into {r} alike groups; choose a replica "
                              f"count that does")
    if not replicas_may_fit_dram(spec, topo, r, wl):
        raise InfeasibleError(f"{spec.name}: {r} replicas of the pipeline do not fit in the DRAM of "
                              f"{topo.name!r} together")
    with progress.step(f"choosing pipeline stages for {r} replicas over {len(group.devices)} devices each"):
        pp = plan_pipeline(spec, group, wl, solve, objective, ceiling)
    if not replicas_fit_dram(topo, r, pp.stages):
        raise InfeasibleError(f"{spec.name}: {r} replicas of the pipeline do not fit in the DRAM of "
                              f"{topo.name!r} together")
    return dataclasses.replace(pp, replicas=r, replica_step=replica_step(topo, r))


LLAMA_CPP = "llama.cpp --split-mode layer"


def llama_cpp_baseline(spec, topo: Topology, wl, req, objective: str) -> dict:
    """llama.cpp ``--split-mode layer -ngl 999`` with its default ``--tensor-split`` (by free
    memory; ``hetplan.solvers.split_mode``): each stage's layers all on its GPU (the embedding on
    the CPU), executed as the ``ngl`` baseline says, hops priced like the pipeline's."""
    from hetplan.compiler import stage_solver
    from hetplan.solvers.split_mode import tensor_split

    split = llama_cpp_split(spec, topo)
    machines = [topo.device_hw(d) for d in topo.devices]
    out = {"tensor_split": tensor_split([m.gpu_budget_bytes() if m.gpus else m.cpu_budget_bytes()
                                         for m in machines]),
           "stages": [list(s) for s in split], "fits": False}
    pp = fixed_pipeline(spec, topo, wl, split, stage_solver(req, "ngl", ALL_LAYERS), objective)
    if pp is not None:
        p = pp.predicted()
        out.update(fits=True, **{k: p[k] for k in ("ttft_s", "tpot_s", "decode_tokens_per_s",
                                                    "prefill_tokens_per_s")})
    return out


ALL_LAYERS = 1 << 20
"""``-ngl`` of every slot (llama.cpp's ``-ngl 999``)."""


def _note(pp: PipelinePlan, topo: Topology, req) -> None:
    pred = pp.predicted()
    used = ", ".join(f"{topo.device_name(s.device)} layers {s.first_layer}-{s.end_layer - 1}" for s in pp.stages)
    line = (f"pipeline over {len(pp.stages)} of {len(topo.devices)} devices ({used}): decode "
            f"{pred['decode_tokens_per_s']:.3g} tok/s")
    if pp.replicas > 1:
        line = (f"{pp.replicas} replicas of a pipeline over {len(pp.stages)} device(s) each (the first: {used}): "
                f"decode {pred['decode_tokens_per_s']:.3g} tok/s"
                + (f", {pred['pipelined_decode_tokens_per_s']:.3g} with micro-batches" if pp.objective == "max" else "")
                + ", all replicas together")
    if pp.alone is not None:
        ratio = pp.alone[0] * pp.replicas / pp.objective_s()
        line += (f", {ratio:.2f}x the best single device" if pp.alone[1]
                 else f", at least {ratio:.2f}x any single device (a lower bound ruled them out unsolved)")
    else:
        line += "; no single device holds the model"
    req.notes.append(line + "; plan.json's main part is the first stage, its 'pipeline' the whole")

