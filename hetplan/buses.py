"""Shared memory buses: one DRAM bus per node, one HBM per GPU, and how concurrent tasks divide them.

Knows tasks only by resource, nominal duration and bytes; nothing about models, solvers or plans.

Which buses a task uses follows from its resource: CPU compute reads and writes DRAM; GPU
compute reads and writes HBM; every copy (``h2d``, ``d2h``, ``h2d_act``, ``d2h_act``) reads one
and writes the other, so it uses both. ``Task.bytes`` is what the task moves on each of its
buses (a copy moves the same bytes over both).

Effective capacity of a bus (bytes/s), the most all its users together can move:

    C_dram = cpu.mem_bandwidth * eff_cpu_mem        C_hbm = gpu.mem_bandwidth * eff_gpu_mem

The efficiency is what a memory's controller delivers of its peak under any mix of readers
(refresh, bank conflicts, read/write turnarounds), not a property of who issues the reads: the
CPU's roofline already reaches C_dram alone, so a DMA out of pinned DRAM during a
bandwidth-bound CPU task takes its bytes from the CPU's share, and a lone copy is limited by
min(link * eff_link, C_dram, C_hbm) (the cost model's copy time is the first term).

Fluid rule (max-min fair sharing, by progressive filling). A task i of nominal duration d_i
(its time alone, from the cost model) moving b_i bytes demands a_i = b_i / d_i on each bus it
uses. Among the tasks running at an instant, every task's bandwidth r_i starts at 0 and all
rise together; a task stops rising when it reaches its demand a_i or when a bus it uses is full
(sum of the r_j on it = C_x); the others keep rising until every task has stopped. So a bus
that is not oversubscribed gives every user its demand, and an oversubscribed one gives each
user min(a_i, its fair share of what the others leave). Task i then progresses at
rho_i = r_i / a_i of its nominal speed (its remaining nominal seconds fall by rho_i per second).
Rates change only when a task starts or ends; between those events they are constant, so an
event-driven replay is exact. Tasks with no bytes or no duration use no bus (rho = 1).

Two tasks on one bus, demands a_1 <= a_2, a_1 + a_2 > C: r_1 = min(a_1, C / 2), r_2 = C - r_1.
A copy at the link rate beside a bandwidth-bound CPU task (a_2 = C_dram) therefore keeps its
rate while the CPU task gets the rest; both end by (b_1 + b_2) / C when the CPU task is last.
"""

from __future__ import annotations

from collections import deque

BUSES_OF = {"cpu": ("dram",), "gpu": ("hbm",), "h2d": ("dram", "hbm"), "d2h": ("dram", "hbm"),
            "h2d_act": ("dram", "hbm"), "d2h_act": ("dram", "hbm")}
"""resource -> the buses its tasks use."""

_DONE = 1e-12
"""A task whose remaining nominal time is below this fraction of its duration has ended."""


def capacities(hw) -> dict:
    """bus -> effective bytes/s (module docstring); a CPU-only node has no HBM."""
    caps = {"dram": hw.cpu.mem_bytes_per_s * hw.efficiency["cpu_mem"]}
    if hw.gpu is not None:
        caps["hbm"] = hw.gpu.mem_bytes_per_s * hw.efficiency["gpu_mem"]
    return caps


def demand(task) -> float:
    """a_i = bytes / nominal duration (bytes/s on each bus the task uses), 0 for an instant task."""
    return task.bytes / task.duration_s if task.duration_s > 0 and task.bytes > 0 else 0.0


def rates(running, caps: dict | None) -> dict:
    """task id -> rho_i for the tasks ``running`` (module docstring); ``caps`` None: all 1."""
    if caps is None or _within(running, caps):   # no bus oversubscribed: every task at its demand
        return {t.id: 1.0 for t in running}
    want = {t.id: demand(t) for t in running}
    rate = {t.id: 0.0 for t in running}
    buses = {t.id: [x for x in BUSES_OF[t.resource] if x in caps] for t in running}
    rising = [tid for tid in want if want[tid] > 0 and buses[tid]]  # a list: sums in a fixed order
    while rising:
        room = {}
        for x in caps:
            users = [tid for tid in rising if x in buses[tid]]
            if users:
                used = sum(rate[tid] for tid in rate if x in buses[tid])
                room[x] = (max(0.0, caps[x] - used), len(users))
        step = min([want[tid] - rate[tid] for tid in rising] + [left / n for left, n in room.values()])
        for tid in rising:
            rate[tid] += step
        full = [x for x, (left, n) in room.items() if left - step * n <= _DONE * caps[x]]
        rising = [tid for tid in rising
                  if rate[tid] < want[tid] * (1 - _DONE) and not any(x in full for x in buses[tid])]
    return {tid: (min(1.0, rate[tid] / want[tid]) if want[tid] > 0 and buses[tid] else 1.0) for tid in want}


def _within(running, caps: dict) -> bool:
    """Whether the demands on every bus sum to at most its capacity (the progressive filling then
    stops every task at its demand)."""
    load = dict.fromkeys(caps, 0.0)
    for t in running:
        a = demand(t)
        if a > 0:
            for x in BUSES_OF[t.resource]:
                if x in load:
                    load[x] += a
    return all(load[x] <= caps[x] for x in caps)


def fluid_times(tasks, edges, caps: dict | None) -> dict:
    """Start and end of every task -> {id: (start_s, end_s)}: each resource serves its tasks in
    list order, one at a time, a task starting when its resource is free and its predecessors
    (``edges``) have ended, and progressing at its fluid rate (``caps`` None: at full speed, so
    every task lasts its nominal duration)."""
    by_id = {t.id: t for t in tasks}
    waiting = {t.id: 0 for t in tasks}
    after = {t.id: [] for t in tasks}
    for src, dst in edges:
        after[src].append(dst)
        waiting[dst] += 1
    queues = {}
    for t in tasks:
        queues.setdefault(t.resource, deque()).append(t.id)
    free = {r: True for r in queues}
    left, start, end = {}, {}, {}
    now = 0.0
    while True:
        started = True
        while started:  # start every queue head that is ready; an instant task ends at once
            started = False
            for r, q in queues.items():
                if free[r] and q and waiting[q[0]] == 0:
                    tid = q.popleft()
                    start[tid] = now
                    started = True
                    if by_id[tid].duration_s > 0:
                        free[r] = False
                        left[tid] = by_id[tid].duration_s
                    else:
                        _finish(tid, now, end, after, waiting)
        if not left:
            break
        running = [by_id[tid] for tid in left]
        rho = rates(running, caps)
        step = min(left[tid] / rho[tid] for tid in left)
        now += step
        for tid in list(left):
            left[tid] -= rho[tid] * step
            if left[tid] <= _DONE * by_id[tid].duration_s:
                del left[tid]
                free[by_id[tid].resource] = True
                _finish(tid, now, end, after, waiting)
    if len(end) < len(by_id):
        stuck = sorted(set(by_id) - set(end))[:3]
        raise ValueError(f"tasks never become ready (a cycle through edges and queue order): {stuck}")
    return {tid: (start[tid], end[tid]) for tid in by_id}


def _finish(tid, now, end, after, waiting) -> None:
    end[tid] = now
    for s in after[tid]:
        waiting[s] -= 1
