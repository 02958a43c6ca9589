"""Turn a solver's Decision into the plan's task DAG, its timeline and its memory.

One rule set, used for every strategy: which tasks exist (stages on their devices, activation
copies where consecutive stages change device, weight loads of streamed blocks, the prompt's KV
copied down when the cache lives in DRAM; an MoE block resident on the GPU split into its hot
and cold experts, ``hetplan.experts``, its cold experts loaded like a streamed block's weights
in a phase whose exec says ``stream``; its tasks carry expected times and its merge the expected
wait for the later side, so the block's span is its expected makespan), the order of tasks on
each resource, and the dependency edges. Times come from the fluid replay of ``hetplan.buses``:
each resource serves its tasks in order, a task starts when its resource is free and its
predecessors have ended, and tasks that overlap divide the DRAM bus and the HBM they use
(without sharing, that is the longest path through the DAG and the queue orders;
``shared_buses=False`` gives it, which the count MILP's chain is checked against).
The ILP encodes the same rules as constraints in its own code; the simulator replays the result
independently.

Queue order on ``h2d`` (weight loads): block order. With one staging slot (depth 1) the load of
block b is issued when block b - 1 finishes (and frees the slot); with two (depth 2, double
buffering) when block b - 1 is ready to start: after the task its first stage waits on (block
b - 2's last stage, or the copy of b - 1's input), by which time b - 2, the last user of b's
slot, has finished. Either way a load never waits for the one before it, so a streamed block
starts at  S_b = max(E_(b-1) + copy_b, W_b + load_b)  with W_b = E_(b-1) (depth 1) or S_(b-1)
(depth 2): the makespan is a sum over consecutive pairs of blocks, which the solvers use. On ``d2h``: the
prompt-KV downloads, in stage order. Activation copies between stages on different devices are a
few KB to MB and ride their own lanes (``h2d_act``, ``d2h_act``: separate high-priority streams),
so they never queue behind a prefetch of a whole block.
"""

from __future__ import annotations

import dataclasses

from hetplan import cost
from hetplan.buses import capacities, fluid_times
from hetplan.graph import PHASES
from hetplan.plan import Decision, PhaseSchedule, Task
from hetplan.problem import Problem


def stage_device(dec: Decision, phase: str, stage) -> str:
    if stage.follows == "kv":
        return dec.kv[stage.block]
    return dec.device(phase, stage.block)


def split_experts(problem: Problem, dec: Decision, phase: str, stage):
    """The ``ExpertLayer`` of an MoE stage whose block is resident on the GPU (it then runs as
    the expert-split tasks of ``hetplan.experts``), else None."""
    if stage.kind != "moe" or dec.weights[stage.block] != "gpu":
        return None
    return problem.experts.get(phase, {}).get(stage.block)


def _split_tasks(x, n: int, block: str, slot: int | None = None) -> tuple[list, list]:
    """(tasks in queue order, their inner edges) of an MoE block with ``n`` experts on the GPU
    in this phase (all of them when its cold experts are streamed into staging ``slot``); the
    first task is the router, the last the one whose output the next stage reads."""
    route = Task(id=f"moe_route/{block}", resource="gpu", block=block, kind="moe_route",
                 duration_s=x.route_s(), flops=x.route_work()[0], bytes=x.route_work()[1], slot=slot)
    hot = Task(id=f"moe_experts/{block}", resource="gpu", block=block, kind="moe_experts",
               duration_s=x.hot_s(n), flops=x.hot_work(n)[0], bytes=x.hot_work(n)[1], slot=slot)
    if n >= x.n_experts:
        return [route, hot], [(route.id, hot.id)]
    down = Task(id=f"act_down/moe_cold/{block}", resource="d2h_act", block=block, kind="act_down",
                duration_s=x.down_s(n), bytes=x.down_bytes(n))
    cold = Task(id=f"moe_cold/{block}", resource="cpu", block=block, kind="moe_cold",
                duration_s=x.cold_s(n), flops=x.cold_work(n)[0], bytes=x.cold_work(n)[1])
    up = Task(id=f"act_up/moe_merge/{block}", resource="h2d_act", block=block, kind="act_up",
              duration_s=x.up_s(n), bytes=x.up_bytes(n))
    merge = Task(id=f"moe_merge/{block}", resource="gpu", block=block, kind="moe_merge",
                 duration_s=x.merge_s(n) + x.wait_s(n), bytes=x.merge_bytes(n))
    edges = [(route.id, hot.id), (route.id, down.id), (down.id, cold.id), (cold.id, up.id),
             (up.id, merge.id), (hot.id, merge.id)]
    return [route, hot, down, cold, up, merge], edges


def copied_cache_attention(problem: Problem, dec: Decision, work):
    """(work, seconds, cost source) of a decode ``attn_core`` on the CPU whose cache is copied
    before it is read: its bytes (``cost.attention_decode_work``: all of them the KV read) times
    ``dec.cpu_attention_bytes_per_cache_byte``, its time the CPU roofline of those bytes, as for
    any CPU task (analytic even where a profile measured the in-place read: the table holds no
    copying attention)."""
    w = dataclasses.replace(work, bytes=work.bytes * dec.cpu_attention_bytes_per_cache_byte)
    return w, cost.cpu_seconds(w, problem.model, problem.hw), "analytic"


def streamed_slots(problem: Problem, dec: Decision, phase: str) -> dict:
    """block -> staging slot, round-robin over the blocks streamed in ``phase``."""
    streamed = [b.name for b in problem.blocks if dec.exec[phase][b.name] == "stream"]
    return {name: i % dec.depth for i, name in enumerate(streamed)}


def build_phase(problem: Problem, dec: Decision, phase: str, shared_buses: bool = True) -> PhaseSchedule:
    if dec.depth not in (1, 2):
        raise ValueError(f"staging depth must be 1 or 2, got {dec.depth}")
    costs = problem.stages[phase]
    names = [b.name for b in problem.blocks]
    index = {n: i for i, n in enumerate(names)}
    slots = streamed_slots(problem, dec, phase)
    compute, acts, h2d, d2h, edges = [], [], [], [], []
    last_stage = {}   # block -> id of its last stage
    first_stage = {}  # block -> id of its first stage
    ready = {}        # block -> id of the task its first stage waits on in the chain
    prev_id, prev_dev = None, None
    for sc in costs:
        st = sc.stage
        dev = stage_device(dec, phase, st)
        w = st.work
        split = split_experts(problem, dec, phase, st)
        if split is not None:
            n = split.n_experts if st.block in slots else dec.hot_experts(st.block, split.n_experts)
            tasks, inner = _split_tasks(split, n, st.block, slots.get(st.block))
            if prev_id is not None and prev_dev != "gpu":
                x = Task(id=f"act_up/{tasks[0].id}", resource="h2d_act", block=st.block, kind="act_up",
                         duration_s=sc.up_s, bytes=st.in_bytes)
                acts.append(x)
                edges += [(prev_id, x.id), (x.id, tasks[0].id)]
                ready[st.block] = x.id
            elif prev_id is not None:
                edges.append((prev_id, tasks[0].id))
                ready[st.block] = prev_id
            compute += [t for t in tasks if t.resource in ("gpu", "cpu")]
            acts += [t for t in tasks if t.resource not in ("gpu", "cpu")]
            edges += inner
            first_stage[st.block], last_stage[st.block] = tasks[0].id, tasks[-1].id
            prev_id, prev_dev = tasks[-1].id, "gpu"
            continue
        secs, source = (sc.gpu_s if dev == "gpu" else sc.cpu_s), sc.source(dev)
        copies = dec.cpu_attention_bytes_per_cache_byte != 1.0
        if copies and dev == "cpu" and st.kind == "attn_core" and st.follows == "kv":
            w, secs, source = copied_cache_attention(problem, dec, w)
        t = Task(id=st.id, resource=dev, block=st.block, kind=st.kind,
                 duration_s=secs, bytes=w.bytes, flops=w.flops,
                 slot=slots.get(st.block) if dev == "gpu" and st.follows == "exec" else None,
                 cost_source=source)
        first_stage.setdefault(st.block, t.id)
        last_stage[st.block] = t.id
        if prev_id is not None:
            if prev_dev == dev:
                edges.append((prev_id, t.id))
                ready.setdefault(st.block, prev_id)
            else:
                kind = "act_up" if dev == "gpu" else "act_down"
                x = Task(id=f"{kind}/{st.id}", resource="h2d_act" if dev == "gpu" else "d2h_act",
                         block=st.block, kind=kind, duration_s=sc.up_s if dev == "gpu" else sc.down_s,
                         bytes=st.in_bytes)
                acts.append(x)
                edges += [(prev_id, x.id), (x.id, t.id)]
                ready.setdefault(st.block, x.id)
        compute.append(t)
        if (phase == "prefill" and st.kind == "attn_core" and dev == "gpu" and dec.kv[st.block] == "cpu"):
            b = problem.graph.block(st.block)
            kv = Task(id=f"kv_down/{st.block}", resource="d2h", block=st.block, kind="kv_down",
                      duration_s=problem.kv_down_s[st.block],
                      bytes=problem.workload.batch * problem.workload.prompt_len * b.kv_bytes_per_token)
            d2h.append(kv)
            edges.append((t.id, kv.id))
        prev_id, prev_dev = t.id, dev

    def load(name):
        b = problem.graph.block(name)
        nbytes, secs = b.weight_bytes, problem.load_s[name]
        if dec.weights[name] == "gpu":  # a resident MoE block's cold experts
            x = problem.experts[phase][name]
            nbytes = (x.n_experts - dec.hot_experts(name, x.n_experts)) * x.expert_bytes
            secs = x.h2d.seconds(0.0, nbytes)
        t = Task(id=f"load/{name}", resource="h2d", block=name, kind="load",
                 duration_s=secs, bytes=nbytes, slot=slots[name])
        edges.append((t.id, first_stage[name]))
        i = index[name]
        if i >= 1:
            before = names[i - 1]
            source = last_stage[before] if dec.depth == 1 else ready.get(before)
            if source is not None:
                edges.append((source, t.id))
        return t

    h2d += [load(n) for n in names if n in slots]
    tasks = compute + acts + h2d + d2h
    caps = capacities(problem.hw) if shared_buses else None
    timed = _timed(tasks, edges, caps)
    done = copy_done_edges(timed, edges)
    if done:  # each already holds on the timeline: the times stay as they are
        edges += done
        timed = _timed(tasks, edges, caps)
    return PhaseSchedule(tuple(timed), tuple(edges))


def copy_done_edges(tasks: list, edges: list) -> list:
    """Edges c -> g that bound how long a copy to the host keeps its value waiting in HBM.

    For every ``act_down``/``kv_down`` c, g is the first task on the ``gpu`` queue that starts
    at or after c ends on the timeline of ``tasks`` (none when no GPU task does), unless g
    already follows c through edges and queue orders. Each edge holds on that timeline, so
    adding it changes no time; what it changes is the runtime, whose lanes may run at other
    speeds: with it, no interleaving lets c's value wait beside more GPU stages than the timeline
    shows (``hetplan.plan.pending`` counts those bytes in the plan's GPU peak)."""
    gpu = [t for t in tasks if t.resource == "gpu"]
    start = {t.id: t.start_s for t in tasks}
    after = {t.id: [] for t in tasks}
    for src, dst in edges:
        after[src].append(dst)
    last = {}
    for t in tasks:
        if t.resource in last:
            after[last[t.resource]].append(t.id)
        last[t.resource] = t.id
    out = []
    for c in tasks:
        if c.kind not in ("act_down", "kv_down"):
            continue
        g = next((t for t in gpu if t.start_s >= c.end_s - 1e-12 * max(c.end_s, 1e-12)), None)
        if g is None:
            continue
        # every edge and queue order holds on the timeline, so no task that starts after g
        # starts can lead to g: the search leaves them out
        horizon = g.start_s + 1e-12 * max(g.start_s, 1e-12)
        seen, stack = set(), [c.id]
        while stack and g.id not in seen:
            for n in after[stack.pop()]:
                if n not in seen and start[n] <= horizon:
                    seen.add(n)
                    stack.append(n)
        if g.id not in seen:
            out.append((c.id, g.id))
    return out


def _timed(tasks: list, edges: list, caps: dict | None) -> list:
    """Every task with its start and end from the fluid replay (``hetplan.buses.fluid_times``)."""
    times = fluid_times(tasks, edges, caps)
    return [Task(**{**t.__dict__, "start_s": times[t.id][0], "end_s": times[t.id][1]}) for t in tasks]


def build_schedule(problem: Problem, dec: Decision, shared_buses: bool = True) -> dict:
    """phase -> its PhaseSchedule; ``shared_buses`` False times every task at its nominal
    duration (each bus exclusive to each task), the timeline the MILP's chain constraints model.
    The last few replays are kept by the identity of their (frozen) problem and decision: a plan's
    is asked for by the compiler, to weigh it against the baselines, then to assemble it."""
    for p, d, shared, schedule in _RECENT:
        if p is problem and d is dec and shared == shared_buses:
            return dict(schedule)
    schedule = {phase: build_phase(problem, dec, phase, shared_buses) for phase in PHASES}
    _RECENT.insert(0, (problem, dec, shared_buses, schedule))
    del _RECENT[RECENT:]
    return dict(schedule)


RECENT = 4
"""Replays ``build_schedule`` keeps."""
_RECENT: list = []
