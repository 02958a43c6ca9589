"""The independent simulator: replays a plan's task DAG and checks that the plan can run.

It reads only what a plan file holds (tasks with durations and resources, dependency edges,
placement entries, staging depth, memory breakdown, the machine's budgets) and recomputes, by
event-driven list scheduling, when every task starts and ends: a task starts as soon as it is
at the head of its resource's queue (queue order = order in the plan's task list), the resource
is idle, and every predecessor has ended. From that replay it derives each phase's makespan,
each resource's busy time, the staging slots in use over time and the peak bytes per tier.

It knows nothing about the cost model, the solver or the schedule builder and shares no code
with them: durations are taken as given, and every rule it checks is restated here.

Shared buses (restated from ``hetplan.buses``): CPU tasks move their bytes over DRAM, GPU tasks
over HBM, copies over both. Bus capacities are C_dram = cpu mem_bandwidth * eff cpu_mem and
C_hbm = gpu mem_bandwidth * eff gpu_mem. A running task with duration d and bytes b demands
a = b / d of each of its buses. The running tasks share the buses max-min fairly: the bandwidth
granted to each is raised in equal steps until it reaches the task's demand or a bus it uses
is full. The task then progresses at (granted / a) of its nominal speed, re-evaluated whenever
a task starts or ends, so its replayed time is at least its duration.

Staging discipline: a ``load`` occupies its slot from its start until the end of the last
compute task of its block in that phase; two occupancies of one slot must not overlap, slots are
numbered ``0 .. depth - 1``, and a compute task that reads a slot starts after its load ended.
Those are checked on the replay's times; the graph must also guarantee them whatever the tasks
really take (``check_slot_reuse``): every reader of a slot is an ancestor of the next load into it.

Values waiting for copies to the host (``hetplan.plan.waiting``, restated there): the GPU peak
also holds the most bytes that copies out of the GPU keep in HBM at one instant of the replay,
and the plan's ``memory.breakdown.gpu.copies_out`` must not be below it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.plan.sharing import bus_capacity, bus_speeds
from hetplan.plan.waiting import waiting_peak_bytes

PHASES = ("prefill", "decode")
COMPUTE_RESOURCES = ("gpu", "cpu")
_REL_TOL = 1e-9
"""Slack for comparing times and bytes read back from a plan file (rounded to 10 digits)."""


class PlanInvalid(HetplanError):
    """A plan that cannot run as written: a cycle, a broken dependency, misused staging, or
    memory over budget. The message says which task or tier, and by how much."""


@dataclass(frozen=True)
class SimResult:
    makespan_s: dict
    """phase -> end of its last task (the replay starts at 0)."""
    peak_bytes: dict
    """tier (``gpu``, ``cpu``) -> resident weights + KV + peak concurrent staging + workspace
    (GPU: + the most bytes waiting for copies to the host, ``waiting_bytes``)."""
    busy_s: dict
    """phase -> resource -> summed task durations."""
    max_slots_in_use: dict
    """phase -> most staging slots occupied at one instant."""
    staging_peak_bytes: dict
    """phase -> most bytes held in occupied staging slots at one instant."""
    start_s: dict
    """phase -> task id -> replayed start time."""
    end_s: dict
    """phase -> task id -> replayed end time."""
    waiting_bytes: dict
    """phase -> most GPU bytes waiting at one instant for copies to the host (``hetplan.plan.waiting``)."""


# -- list scheduling ---------------------------------------------------------------------------

def replay(tasks, edges, phase: str = "phase", capacity: dict | None = None) -> tuple[dict, dict]:
    """Event-driven list scheduling of ``tasks`` (each with ``id``, ``resource``,
    ``duration_s``, ``bytes``) under ``edges`` (src id, dst id) -> (start_s, end_s) by task id.

    Each resource is a serial queue served in list order. ``capacity`` (bus -> bytes/s, None:
    no sharing) slows tasks that overlap on a bus by the rule of the module docstring. Raises
    PlanInvalid on duplicate ids, unknown edge endpoints, negative durations, or a cycle (tasks
    that never become ready)."""
    by_id = {}
    for t in tasks:
        if t.id in by_id:
            raise PlanInvalid(f"{phase}: task id {t.id!r} appears twice; recompile the plan")
        if not t.duration_s >= 0:
            raise PlanInvalid(f"{phase}: task {t.id!r} has duration {t.duration_s!r}; durations must be >= 0")
        by_id[t.id] = t
    waiting = {tid: 0 for tid in by_id}
    successors = {tid: [] for tid in by_id}
    for src, dst in edges:
        for end in (src, dst):
            if end not in by_id:
                raise PlanInvalid(f"{phase}: edge {src!r} -> {dst!r} names no task {end!r}")
        successors[src].append(dst)
        waiting[dst] += 1
    queues = {}
    for t in tasks:
        queues.setdefault(t.resource, deque()).append(t.id)
    busy = {r: False for r in queues}
    start, end, remaining = {}, {}, {}
    now = 0.0

    def complete(tid):
        end[tid] = now
        busy[by_id[tid].resource] = False
        for s in successors[tid]:
            waiting[s] -= 1

    def dispatch():
        progress = True
        while progress:
            progress = False
            for r, q in queues.items():
                if not busy[r] and q and waiting[q[0]] == 0:
                    tid = q.popleft()
                    busy[r], start[tid], progress = True, now, True
                    if by_id[tid].duration_s > 0:
                        remaining[tid] = by_id[tid].duration_s
                    else:
                        complete(tid)

    dispatch()
    while remaining:
        speed = bus_speeds([by_id[tid] for tid in remaining], capacity)
        dt = min(remaining[tid] / speed[tid] for tid in remaining)
        now += dt
        for tid in list(remaining):
            remaining[tid] -= speed[tid] * dt
            if remaining[tid] <= 1e-12 * by_id[tid].duration_s:
                del remaining[tid]
                complete(tid)
        dispatch()
    if len(end) < len(by_id):
        raise PlanInvalid(f"{phase}: tasks never become ready, a dependency cycle through edges and "
                          f"queue order: {_stuck(queues, waiting, successors, end)}; recompile the plan")
    return start, end


def _stuck(queues, waiting, successors, end) -> str:
    """Name the blocked queue heads and what each still waits for."""
    preds = {}
    for src, dsts in successors.items():
        for d in dsts:
            if src not in end:
                preds.setdefault(d, []).append(src)
    parts = []
    for r, q in queues.items():
        if q:
            head = q[0]
            why = ", ".join(preds.get(head, [])) or "an earlier task of its queue"
            parts.append(f"{head} on {r} waits for {why}")
    return "; ".join(parts[:4])


# -- staging slots -----------------------------------------------------------------------------

def staging_occupancy(tasks, start: dict, end: dict, depth: int, slot_bytes: float,
                      phase: str = "phase") -> tuple[int, float]:
    """Check the staging discipline of one phase's replay -> (max slots in use, peak bytes).

    A load of block b into slot s occupies s (with the load's bytes: the block's weights, or a
    resident MoE block's cold experts) over [start(load), max end of b's compute tasks).
    Raises PlanInvalid when a slot is outside 0..depth-1, a load does not fit a slot, a block is
    loaded twice or never used, a reader starts before its load ended or reads another slot,
    two occupancies of one slot overlap, or more than ``depth`` slots are in use at once."""
    loads, last_use = {}, {}
    for t in tasks:
        if t.kind == "load":
            if t.block in loads:
                raise PlanInvalid(f"{phase}: block {t.block} is loaded twice ({loads[t.block].id}, {t.id})")
            if not isinstance(t.slot, int) or not 0 <= t.slot < depth:
                raise PlanInvalid(f"{phase}: {t.id} uses staging slot {t.slot!r}, but the plan has "
                                  f"depth {depth} (slots 0..{depth - 1})")
            if t.bytes > slot_bytes * (1 + _REL_TOL):
                raise PlanInvalid(f"{phase}: {t.id} copies {t.bytes:.0f} bytes into a staging slot of "
                                  f"{slot_bytes:.0f} bytes")
            loads[t.block] = t
        elif t.resource in COMPUTE_RESOURCES:
            last_use[t.block] = max(last_use.get(t.block, 0.0), end[t.id])
    for t in tasks:
        if t.resource == "gpu" and t.slot is not None:
            load = loads.get(t.block)
            if load is None:
                raise PlanInvalid(f"{phase}: {t.id} reads staging slot {t.slot} but block {t.block} "
                                  f"is never loaded")
            if t.slot != load.slot:
                raise PlanInvalid(f"{phase}: {t.id} reads slot {t.slot} but {load.id} filled slot {load.slot}")
            if start[t.id] < end[load.id] - _tol(end[load.id]):
                raise PlanInvalid(f"{phase}: {t.id} starts at {start[t.id]:.9g} s, before its weights "
                                  f"arrive ({load.id} ends at {end[load.id]:.9g} s)")
    intervals = []
    for block, load in loads.items():
        if block not in last_use:
            raise PlanInvalid(f"{phase}: {load.id} loads weights no compute task of block {block} uses")
        intervals.append((start[load.id], last_use[block], load.slot, load.id, load.bytes))
    by_slot = {}
    for iv in sorted(intervals):
        prev = by_slot.get(iv[2])
        if prev is not None and iv[0] < prev[1] - _tol(prev[1]):
            raise PlanInvalid(f"{phase}: {iv[3]} overwrites staging slot {iv[2]} at {iv[0]:.9g} s while "
                              f"{prev[3]}'s block still uses it (until {prev[1]:.9g} s)")
        by_slot[iv[2]] = iv
    return _peak_concurrency(intervals, depth, phase)


def check_slot_reuse(tasks, edges, phase: str = "phase") -> None:
    """Refuse a schedule whose graph lets a load overwrite a staging slot that a task may still read.

    Loads run in list order on their queue. For consecutive loads L1, L2 into slot s, every task
    R of L1's block that reads s (``slot == s``, not a load) must be an ancestor of L2 in the
    graph G = edges + queue order (each task after the one before it on its resource):
    R ∈ anc_G(L2). Timing alone cannot show it: with durations other than the plan's, a load
    not ordered after a reader could start while the reader runs."""
    before = {t.id: [] for t in tasks}
    for src, dst in edges:
        if src in before and dst in before:
            before[dst].append(src)
    last = {}
    for t in tasks:
        if t.resource in last:
            before[t.id].append(last[t.resource])
        last[t.resource] = t.id
    previous = {}
    for t in tasks:
        if t.kind != "load":
            continue
        earlier = previous.get(t.slot)
        previous[t.slot] = t
        if earlier is None:
            continue
        readers = [r.id for r in tasks if r.block == earlier.block and r.slot == t.slot and r.kind != "load"]
        ancestors, stack = set(), [t.id]
        while stack:
            for p in before[stack.pop()]:
                if p not in ancestors:
                    ancestors.add(p)
                    stack.append(p)
        missing = [r for r in readers if r not in ancestors]
        if missing:
            raise PlanInvalid(f"{phase}: {t.id} may overwrite staging slot {t.slot} while {missing[0]} still "
                              f"reads {earlier.block}'s weights there: no chain of edges orders {missing[0]} "
                              f"before {t.id}; recompile the plan")


def _peak_concurrency(intervals, depth: int, phase: str) -> tuple[int, float]:
    """Sweep occupancy intervals (ends before starts at equal times) -> (max count, max bytes)."""
    events = sorted([(b, 0, -1, -nbytes) for _, b, _, _, nbytes in intervals]
                    + [(a, 1, 1, nbytes) for a, _, _, _, nbytes in intervals])
    count = peak_count = 0
    held = peak_held = 0.0
    for _, _, dc, db in events:
        count += dc
        held += db
        peak_count, peak_held = max(peak_count, count), max(peak_held, held)
    if peak_count > depth:
        raise PlanInvalid(f"{phase}: {peak_count} staging slots in use at once, but depth is {depth}")
    return peak_count, peak_held


def _tol(t: float) -> float:
    return _REL_TOL * max(abs(t), 1e-12)


# -- the whole plan ----------------------------------------------------------------------------

def simulate(plan) -> SimResult:
    """Replay both phases of ``plan`` and check its staging discipline."""
    depth = plan.staging["depth"]
    if not isinstance(depth, int) or depth < 1:
        raise PlanInvalid(f"staging.depth must be a positive integer, got {depth!r}")
    entries = {p["block"]: p for p in plan.placement}
    makespan, busy, slots, staged, starts, ends, waiting = {}, {}, {}, {}, {}, {}, {}
    for phase in PHASES:
        if phase not in plan.schedule:
            raise PlanInvalid(f"schedule: phase {phase!r} is missing; recompile the plan")
        sched = plan.schedule[phase]
        for t in sched.tasks:
            if t.block not in entries:
                raise PlanInvalid(f"{phase}: task {t.id} belongs to block {t.block!r}, which the "
                                  f"placement does not list")
        start, end = replay(sched.tasks, sched.edges, phase, bus_capacity(plan.hardware))
        slots[phase], staged[phase] = staging_occupancy(sched.tasks, start, end, depth,
                                                        plan.staging["slot_bytes"], phase)
        check_slot_reuse(sched.tasks, sched.edges, phase)
        makespan[phase] = max(end.values(), default=0.0)
        busy[phase] = {}
        for t in sched.tasks:
            busy[phase][t.resource] = busy[phase].get(t.resource, 0.0) + t.duration_s
        starts[phase], ends[phase] = start, end
        waiting[phase] = waiting_peak_bytes(plan, sched.tasks, sched.edges, start, end)
    peak = _peak_bytes(plan, max(staged.values()), max(waiting.values()))
    return SimResult(makespan, peak, busy, slots, staged, starts, ends, waiting)


def _peak_bytes(plan, staging_bytes: float, waiting_bytes: float) -> dict:
    """GPU: weights resident in HBM (less an MoE block's cold experts) + KV caches in HBM + peak
    staging + GPU workspace + the most bytes waiting for copies to the host; CPU: weights in
    DRAM (``cpu`` and ``stream``, cold experts) + KV caches in DRAM + CPU workspace."""
    ws = plan.memory["breakdown"]
    gpu = staging_bytes + ws["gpu"]["workspace"] + waiting_bytes
    cpu = ws["cpu"]["workspace"]
    for p in plan.placement:
        if p["weights"] == "gpu":
            cold = p.get("cold_expert_bytes") or 0.0   # an MoE block's experts kept in DRAM
            gpu += p["weight_bytes"] - cold
            cpu += cold
        else:
            cpu += p["weight_bytes"]
        if p["kv"] == "gpu":
            gpu += p["kv_bytes"]
        elif p["kv"] == "cpu":
            cpu += p["kv_bytes"]
    return {"gpu": gpu, "cpu": cpu}


def check_plan(plan, rel_tol: float = 1e-6) -> SimResult:
    """Simulate ``plan`` and raise PlanInvalid on anything that would stop it from running as
    written: a cycle, a recorded start before a predecessor's end or overlapping tasks on one
    resource, a task where its weights or KV cache are not, staging misuse, memory over budget
    or under-reported, or predicted makespans that differ from the replay by more than
    ``rel_tol``."""
    sim = simulate(plan)
    for phase in PHASES:
        on_gpu = [t for t in plan.schedule[phase].tasks if t.resource != "cpu"]
        if on_gpu and not plan.hardware.gpus:
            raise PlanInvalid(f"{phase}: the node has no GPU, but {on_gpu[0].id} runs on "
                              f"{on_gpu[0].resource!r}")
        _check_recorded_times(plan.schedule[phase], phase)
        _check_replayed_times(plan.schedule[phase], sim.start_s[phase], sim.end_s[phase], phase, rel_tol)
        _check_placement(plan, plan.schedule[phase], phase)
    for phase, key in (("prefill", "ttft_s"), ("decode", "tpot_s")):
        predicted, replayed = plan.predicted[key], sim.makespan_s[phase]
        if abs(predicted - replayed) > rel_tol * max(abs(replayed), 1e-12):
            raise PlanInvalid(f"predicted.{key} = {predicted:.9g} s, but replaying the {phase} schedule "
                              f"takes {replayed:.9g} s")
    declared = plan.memory["breakdown"]["gpu"].get("copies_out", 0.0)
    waiting = max(sim.waiting_bytes.values())
    if declared < waiting * (1 - _REL_TOL):
        raise PlanInvalid(f"memory.breakdown.gpu.copies_out = {declared:.0f} under-reports the {waiting:.0f} bytes "
                          f"that wait in HBM for copies to the host in the replay; recompile the plan")
    budgets = {"gpu": plan.hardware.gpu_budget_bytes(), "cpu": plan.hardware.cpu_budget_bytes()}
    for tier, peak in sim.peak_bytes.items():
        declared = plan.memory[f"{tier}_bytes"]
        if peak > budgets[tier] * (1 + _REL_TOL):
            raise PlanInvalid(f"{tier.upper()} memory: the plan needs {peak:.0f} bytes at its peak, over "
                              f"the budget of {budgets[tier]:.0f} bytes; recompile with the current node")
        if declared > budgets[tier] * (1 + _REL_TOL):
            raise PlanInvalid(f"memory.{tier}_bytes = {declared:.0f} is over the budget of "
                              f"{budgets[tier]:.0f} bytes")
        if declared < peak * (1 - _REL_TOL):
            raise PlanInvalid(f"memory.{tier}_bytes = {declared:.0f} under-reports the replayed peak "
                              f"of {peak:.0f} bytes")
    return sim


def _check_recorded_times(sched, phase: str) -> None:
    """The plan's own start/end times: each task lasts at least its duration (longer where it
    shares a bus), starts after every predecessor ended, and never overlaps the previous task of
    its resource."""
    by_id = {t.id: t for t in sched.tasks}
    for t in sched.tasks:
        if (t.end_s - t.start_s) - t.duration_s < -(_tol(t.end_s) + _tol(t.duration_s)):
            raise PlanInvalid(f"{phase}: {t.id} records {t.start_s:.9g}..{t.end_s:.9g} s, shorter than "
                              f"its duration of {t.duration_s:.9g} s")
    for src, dst in sched.edges:
        a, b = by_id[src], by_id[dst]
        if b.start_s < a.end_s - _tol(a.end_s):
            raise PlanInvalid(f"{phase}: {dst} starts at {b.start_s:.9g} s, before its predecessor "
                              f"{src} ends at {a.end_s:.9g} s")
    last = {}
    for t in sched.tasks:
        prev = last.get(t.resource)
        if prev is not None and t.start_s < prev.end_s - _tol(prev.end_s):
            raise PlanInvalid(f"{phase}: {t.id} starts at {t.start_s:.9g} s on {t.resource} while "
                              f"{prev.id} still runs there (until {prev.end_s:.9g} s)")
        last[t.resource] = t


def _check_replayed_times(sched, start: dict, end: dict, phase: str, rel_tol: float) -> None:
    """Recorded start and end of every task equal the replay's (within ``rel_tol`` of the
    phase's makespan): what the plan shows is what its tasks, sharing the buses, take."""
    scale = max(end.values(), default=0.0)
    for t in sched.tasks:
        for key, rec, rep in (("start", t.start_s, start[t.id]), ("end", t.end_s, end[t.id])):
            if abs(rec - rep) > rel_tol * max(scale, 1e-12):
                raise PlanInvalid(f"{phase}: {t.id} records its {key} at {rec:.9g} s, but the replay with "
                                  f"shared buses has {rep:.9g} s; recompile the plan")


def _check_placement(plan, sched, phase: str) -> None:
    """Every task runs where its inputs are: a stage on the device its block's ``exec`` names,
    with its weights resident there or loaded into a slot this phase; decode attention beside
    its KV cache (a single-stage ``attn`` in both phases); prefill attention on the GPU copies a
    DRAM-resident cache down."""
    entries = {p["block"]: p for p in plan.placement}
    loaded = {t.block for t in sched.tasks if t.kind == "load"}
    kv_down = {t.block for t in sched.tasks if t.kind == "kv_down"}
    for block in sorted(loaded):
        if entries[block]["exec"][phase] != "stream":
            raise PlanInvalid(f"{phase}: block {block} is loaded, but its placement says exec "
                              f"{entries[block]['exec'][phase]!r}")
    for t in sched.tasks:
        if t.kind != "load":
            continue
        e = entries[t.block]
        # what is not resident: the whole block, or a resident MoE block's cold experts
        away = (e.get("cold_expert_bytes") or 0.0) if e["weights"] == "gpu" else e["weight_bytes"]
        if not away or abs(t.bytes - away) > _tol(away):
            raise PlanInvalid(f"{phase}: {t.id} copies {t.bytes:.0f} bytes, but block {t.block} keeps "
                              f"{away:.0f} bytes outside HBM")
    for t in sched.tasks:
        if t.resource not in COMPUTE_RESOURCES:
            continue
        e = entries[t.block]
        if t.kind == "attn_core":
            kv = e["kv"]
            if phase == "decode" and t.resource != kv:
                raise PlanInvalid(f"decode: {t.id} runs on the {t.resource.upper()}, but block "
                                  f"{t.block}'s KV cache lives on the {str(kv).upper()}")
            if phase == "prefill" and t.resource == "cpu" and kv == "gpu":
                raise PlanInvalid(f"prefill: {t.id} writes the KV cache on the CPU, but it lives on the GPU")
            if phase == "prefill" and t.resource == "gpu" and kv == "cpu" and t.block not in kv_down:
                raise PlanInvalid(f"prefill: {t.id} writes the KV cache on the GPU, but it lives in DRAM "
                                  f"and no kv_down task copies it there")
            continue
        if t.kind == "attn" and e["kv"] is not None and t.resource != e["kv"]:
            raise PlanInvalid(f"{phase}: {t.id} reads and writes the KV cache on the "
                              f"{t.resource.upper()}, but block {t.block}'s cache lives on the "
                              f"{e['kv'].upper()}")
        if t.kind == "moe_cold":
            if t.resource != "cpu" or e["weights"] != "gpu" or not e.get("cold_expert_bytes"):
                raise PlanInvalid(f"{phase}: {t.id} runs cold experts on the {t.resource.upper()}, but "
                                  f"block {t.block} keeps no experts in DRAM beside GPU-resident weights")
            continue
        if t.kind in ("moe_route", "moe_experts", "moe_merge") and e["weights"] != "gpu":
            raise PlanInvalid(f"{phase}: {t.id} is a task of an expert split, but block {t.block}'s "
                              f"weights are {e['weights']!r}, not resident on the GPU")
        mode = e["exec"][phase]
        device = "cpu" if mode == "cpu" else "gpu"
        if t.resource != device:
            raise PlanInvalid(f"{phase}: {t.id} runs on the {t.resource.upper()}, but block {t.block}'s "
                              f"placement says exec {mode!r}")
        if device == "gpu" and e["weights"] != "gpu" and t.block not in loaded:
            raise PlanInvalid(f"{phase}: {t.id} runs on the GPU, but block {t.block}'s weights stay in "
                              f"DRAM and are never loaded")
        if device == "cpu" and e["weights"] == "gpu":
            raise PlanInvalid(f"{phase}: {t.id} runs on the CPU, but block {t.block}'s weights live "
                              f"only in GPU memory")
