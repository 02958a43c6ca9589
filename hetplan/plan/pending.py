"""GPU bytes that copies to the host leave waiting: a value stays in HBM until its copy ends.

A copy out of the GPU (``act_down``: activations a CPU stage reads; ``kv_down``: the prompt's
KV leaving for a cache in DRAM) reads a value that a GPU stage produced. That value cannot be
freed when the stage ends: it is held until the copy has read it, while later GPU stages run
with their own workspace. The plan's GPU peak (weights + KV + staging + the largest single
stage's workspace) does not hold it, so it is counted here:

    a copy c with GPU predecessor p holds src(c) bytes over [end(p), end(c))
    copies_out = max over t of sum of src(c) for the windows that hold t

where end(p) is the latest end among c's predecessors on the ``gpu`` resource (c's own start if
it has none), and src(c) is what the GPU holds for it:

- ``act_down``: its bytes (the values it moves, in the activation dtype);
- ``kv_down``: the prompt's K/V rows as the stage produced them, in the activation dtype,
  before they are quantised for the cache: its bytes (in the KV dtype) times
  ``kv_source_bytes_per_byte`` = (kv elements per token * activation bytes per element) / (KV
  bytes per token).

The windows are read off the phase's timeline; ``hetplan.schedule`` orders each copy before
the first GPU stage that starts after it ends, so no interleaving of the runtime's lanes lets
a copy wait beside more GPU stages than the timeline shows.

Pure: tasks in, bytes out. Knows nothing about solvers or the runtime.
"""

from __future__ import annotations

COPIES_OUT = ("act_down", "kv_down")


def source_bytes(task, kv_source_bytes_per_byte: float) -> float:
    """GPU bytes held for copy ``task`` until it ends (module docstring)."""
    if task.kind == "kv_down":
        return task.bytes * kv_source_bytes_per_byte
    return task.bytes


def held_windows(tasks, edges, kv_source_bytes_per_byte: float) -> list:
    """[(start_s, end_s, bytes, copy id)] of every copy out of the GPU in ``tasks``."""
    by_id = {t.id: t for t in tasks}
    gpu_before = {}
    for src, dst in edges:
        if by_id[dst].kind in COPIES_OUT and by_id[src].resource == "gpu":
            gpu_before[dst] = max(gpu_before.get(dst, by_id[src].end_s), by_id[src].end_s)
    out = []
    for t in tasks:
        if t.kind in COPIES_OUT:
            nbytes = source_bytes(t, kv_source_bytes_per_byte)
            if nbytes > 0:
                out.append((gpu_before.get(t.id, t.start_s), t.end_s, nbytes, t.id))
    return out


def peak_held_bytes(windows) -> float:
    """Most bytes held at one instant by [(start, end, bytes, ...)] windows, each holding its
    bytes over [start, end): a window that ends at t is released before one that starts at t."""
    events = sorted([(w[1], 0, -w[2]) for w in windows] + [(w[0], 1, w[2]) for w in windows])
    held = peak = 0.0
    for _, _, delta in events:
        held += delta
        peak = max(peak, held)
    return peak


def copies_out_bytes(tasks, edges, kv_source_bytes_per_byte: float) -> float:
    """The most GPU bytes one phase's copies to the host hold at once (module docstring)."""
    return peak_held_bytes(held_windows(tasks, edges, kv_source_bytes_per_byte))
