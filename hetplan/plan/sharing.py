"""The simulator's rule for shared buses, restated apart from ``hetplan.buses`` (the schedule
builder's) so that the replay checks the builder rather than repeating it.

CPU tasks move their bytes over DRAM, GPU tasks over HBM, every other resource (a copy) over
both. Capacities: C_dram = cpu mem_bandwidth * eff cpu_mem, C_hbm = gpu mem_bandwidth * eff
gpu_mem. A running task with duration d and bytes b demands a = b / d; the running tasks share
max-min fairly: the bandwidth granted to each rises in equal steps until it reaches the task's
demand or a bus it uses is full. A task progresses at granted / a of its nominal speed.
"""

from __future__ import annotations


_BUSES = {"cpu": ("dram",), "gpu": ("hbm",)}
"""Buses of compute tasks; every other resource is a copy between DRAM and HBM."""


def bus_speeds(running, capacity: dict | None) -> dict:
    """task id -> fraction of its nominal speed while ``running`` run together (max-min fair)."""
    if capacity is None:
        return {t.id: 1.0 for t in running}
    uses = {t.id: [b for b in _BUSES.get(t.resource, ("dram", "hbm")) if b in capacity] for t in running}
    wants = {t.id: t.bytes / t.duration_s for t in running if t.bytes > 0 and uses[t.id]}
    granted = dict.fromkeys(wants, 0.0)
    open_ = list(wants)
    while open_:
        spare = {b: capacity[b] - sum(granted[i] for i in granted if b in uses[i]) for b in capacity}
        sharing = {b: sum(1 for i in open_ if b in uses[i]) for b in capacity}
        raise_by = min(min(wants[i] - granted[i] for i in open_),
                       min(max(spare[b], 0.0) / sharing[b] for b in capacity if sharing[b]))
        for i in open_:
            granted[i] += raise_by
        saturated = [b for b in capacity if sharing[b] and spare[b] - raise_by * sharing[b] <= 1e-12 * capacity[b]]
        open_ = [i for i in open_ if granted[i] < wants[i] * (1 - 1e-12)
                 and not any(b in saturated for b in uses[i])]
    return {t.id: min(1.0, granted[t.id] / wants[t.id]) if t.id in wants else 1.0 for t in running}


def bus_capacity(hardware) -> dict:
    """bus -> bytes/s the bus delivers to all its users together (module docstring)."""
    cap = {"dram": hardware.cpu.mem_bytes_per_s * hardware.efficiency["cpu_mem"]}
    if hardware.gpus:
        cap["hbm"] = hardware.gpus[0].mem_bytes_per_s * hardware.efficiency["gpu_mem"]
    return cap
