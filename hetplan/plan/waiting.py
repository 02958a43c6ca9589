"""The simulator's count of values that wait in HBM for their copies to the host.

Restated here from the plan's rules, apart from the code that builds plans
(``hetplan.plan.pending``), and applied to the simulator's own replay:

- a copy out of the GPU (``act_down``, ``kv_down``) reads a value some ``gpu`` task wrote; the
  value stays in HBM from the end of the copy's last-ending ``gpu`` predecessor until the copy
  ends;
- an ``act_down`` waits with the bytes it moves; a ``kv_down`` with the prompt's K/V as the
  attention stage produced them, batch * prompt_len * (KV elements per token) elements of the
  activation dtype (4 bytes for fp32 weights, else 2), whatever the cache's dtype;
- the plan's GPU peak holds the most such bytes at one instant of either phase, beside the
  largest stage's workspace.
"""

from __future__ import annotations


def activation_bytes(weight_dtype: str) -> int:
    """Bytes per activation element: fp32 models keep fp32 activations, every other 16-bit."""
    return 4 if weight_dtype == "fp32" else 2


def waiting_peak_bytes(plan, tasks, edges, start: dict, end: dict) -> float:
    """Most bytes waiting at once over one phase replayed as ``start``/``end`` (task id -> s)."""
    resource = {t.id: t.resource for t in tasks}
    wl, spec = plan.workload, plan.model
    kv_rows = wl.batch * wl.prompt_len * spec.kv_elems_per_token() * activation_bytes(spec.weight_dtype)
    opened = {}
    for src, dst in edges:
        if resource.get(src) == "gpu":
            opened[dst] = max(opened.get(dst, end[src]), end[src])
    changes = []
    for t in tasks:
        if t.kind not in ("act_down", "kv_down"):
            continue
        held = kv_rows if t.kind == "kv_down" else t.bytes
        since = opened.get(t.id, start[t.id])
        if end[t.id] > since and held > 0:
            changes += [(since, 1, held), (end[t.id], 0, -held)]
    now = peak = 0.0
    for _, _, delta in sorted(changes):
        now += delta
        peak = max(peak, now)
    return peak
