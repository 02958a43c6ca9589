"""llama.cpp's ``--split-mode layer`` with its default ``--tensor-split``: which device runs which
layers (``llama_model::load_tensors``), as a baseline for the pipeline planner and its first
incumbent.

llama.cpp normalises each device's free memory into cumulative fractions ``splits`` and puts
layer slot ``il`` (the repeating layers ``0 .. n-1``, then the output layer as slot ``n``) on the
first device whose cumulative fraction exceeds ``il / (n + 1)`` (all slots offloaded:
``-ngl`` at least ``n + 1``). Over RPC (several machines) the remote devices join the same list.
Here a device's free memory is its budget (memory less the reserve). Leaves out: the output slot
landing on another device than the last layer (it stays with the last layer's stage here).
Knows nothing about models or plans: a pure function of layer counts and budgets.
"""

from __future__ import annotations

import bisect


def tensor_split(free_bytes: list) -> list:
    """Cumulative fractions of the devices' free memory (llama.cpp's default ``--tensor-split``)."""
    total = float(sum(free_bytes))
    out, acc = [], 0.0
    for f in free_bytes:
        acc += f
        out.append(acc / total)
    return out


def layer_stages(n_layers: int, free_bytes: list) -> tuple:
    """(device, first, end) of each device given layers, in order: slot ``il`` on the first device
    with ``splits[d] > il / (n_layers + 1)`` (``std::upper_bound``)."""
    splits = tensor_split(free_bytes)
    device = [min(bisect.bisect_right(splits, il / (n_layers + 1)), len(splits) - 1) for il in range(n_layers)]
    stages, first = [], 0
    for il in range(1, n_layers + 1):
        if il == n_layers or device[il] != device[first]:
            stages.append((device[first], first, il))
            first = il
    return tuple(stages)
