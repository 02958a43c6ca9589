"""A phase's task list, read as a program: what each task reads, writes and waits for.

The plan's schedule says which tasks exist, on which resource, in which order, and which edges
connect them (``hetplan.schedule``). This module adds what the executor needs to move data:

- every stage reads the values its backend declares (``reads(kind)``), each from the latest task
  that produced it *on the stage's device*; a value is named ``(producer op, name)``;
- an ``act_up``/``act_down`` copy before a stage moves exactly the values that stage reads and
  finds only on the other device (``x`` before a block; ``q, k, v`` before an attention core on the
  other side; ``o`` back after it);
- a ``kv_down`` reads the values its block's ``attn_core`` read that the KV cache stores
  (``kv_names``: ``k``/``v``, or MLA's ``latent``/``k_rope``);
- every value counts its readers, so it can be freed after the last one.

A schedule in which a stage would read a value that no task put on its device is refused, and so
is one whose edges and queue order do not make every reader of a staging slot finish before the
next load into that slot starts (``_check_slot_reuse``). Pure Python over the plan's tasks: no
torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.plan import PhaseSchedule, Task

TRANSFERS = ("act_up", "act_down", "load", "kv_down")
INPUT = -1
"""Producer index of the values given to a phase (the token ids)."""


@dataclass(frozen=True)
class Op:
    index: int
    task: Task
    device: str
    """Where the op computes and leaves its values: ``gpu`` or ``cpu``."""
    reads: tuple
    """((producer index, value name), ...)."""
    writes: tuple
    """Value names this op produces, stored as (index, name)."""
    deps: tuple
    """Indices of ops that must finish first (the plan's edges into this task)."""


@dataclass(frozen=True)
class Program:
    phase: str
    ops: tuple
    lanes: dict
    """resource -> op indices in queue order."""
    readers: dict
    """(producer index, name) -> number of ops that read it (+1 for a phase output)."""
    inputs: dict
    """value name -> device it is given on (``ids`` on the embedding's device)."""
    outputs: dict
    """value name -> (producer index, name) of the phase's results (``logits``)."""


def build_program(phase: str, schedule: PhaseSchedule, reads, writes, kv_names=("k", "v")) -> Program:
    """``reads(kind)``/``writes(kind)``: the backend's value names per stage kind; ``kv_names``:
    the values a KV cache stores (the backend's ``kv_shapes`` keys)."""
    tasks = schedule.tasks
    index = {t.id: i for i, t in enumerate(tasks)}
    stages = [i for i, t in enumerate(tasks) if t.kind not in TRANSFERS]
    if not stages:
        raise HetplanError(f"plan schedule {phase}: no compute tasks; recompile the plan")
    copy_before = {t.id.split("/", 1)[1]: i for i, t in enumerate(tasks) if t.kind in ("act_up", "act_down")}
    first = tasks[stages[0]]
    where = {name: (first.resource, INPUT) for name in reads(first.kind)}
    inputs = {name: first.resource for name in reads(first.kind)}
    op_reads, op_writes, core_reads = {}, {}, {}

    for i in stages:
        t = tasks[i]
        if t.id in copy_before:
            c = copy_before.pop(t.id)
            dest = "gpu" if tasks[c].kind == "act_up" else "cpu"
            moved = tuple(n for n in reads(t.kind) if n in where and where[n][0] != dest)
            op_reads[c] = tuple((where[n][1], n) for n in moved)
            op_writes[c] = moved
            for n in moved:
                where[n] = (dest, c)
        for n in reads(t.kind):
            if n not in where or where[n][0] != t.resource:
                found = f"only on {where[n][0]}" if n in where else "nowhere"
                raise HetplanError(f"plan schedule {phase}: task {t.id} on {t.resource} reads {n!r}, which "
                                   f"is {found} at that point (no copy moves it); recompile the plan")
        op_reads[i] = tuple((where[n][1], n) for n in reads(t.kind))
        op_writes[i] = tuple(writes(t.kind))
        if t.kind == "attn_core":
            core_reads[t.block] = tuple(r for r in op_reads[i] if r[1] in kv_names)
        for n in writes(t.kind):
            where[n] = (t.resource, i)
    if copy_before:
        raise HetplanError(f"plan schedule {phase}: copies {sorted(copy_before)} precede no stage; "
                           f"recompile the plan")

    for i, t in enumerate(tasks):
        if t.kind == "kv_down":
            op_reads[i], op_writes[i] = core_reads[t.block], ()
        elif t.kind == "load":
            op_reads[i], op_writes[i] = (), ()

    deps = {i: [] for i in range(len(tasks))}
    for src, dst in schedule.edges:
        if src not in index or dst not in index:
            raise HetplanError(f"plan schedule {phase}: edge {src} -> {dst} names a task that does not "
                               f"exist; recompile the plan")
        deps[index[dst]].append(index[src])
    _check_acyclic(phase, tasks, deps)
    _check_slot_reuse(phase, tasks, deps)
    ops = tuple(Op(i, t, _device(t), op_reads[i], op_writes[i], tuple(deps[i])) for i, t in enumerate(tasks))
    readers = {}
    for op in ops:
        for key in op.reads:
            readers[key] = readers.get(key, 0) + 1
    outputs = {n: (p, n) for n, (_, p) in where.items() if p != INPUT and n in writes(tasks[stages[-1]].kind)}
    for key in outputs.values():
        readers[key] = readers.get(key, 0) + 1
    lanes = {}
    for op in ops:
        lanes.setdefault(op.task.resource, []).append(op.index)
    return Program(phase, ops, {r: tuple(v) for r, v in lanes.items()}, readers, inputs, outputs)


def _check_acyclic(phase: str, tasks, deps: dict) -> None:
    """Queue order plus edges must leave an order to run in, or the lanes would wait forever."""
    after = {i: [] for i in range(len(tasks))}
    waits = {i: len(d) for i, d in deps.items()}
    for i, d in deps.items():
        for j in d:
            after[j].append(i)
    last = {}
    for i, t in enumerate(tasks):
        if t.resource in last:
            after[last[t.resource]].append(i)
            waits[i] += 1
        last[t.resource] = i
    ready = [i for i, n in waits.items() if n == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for j in after[i]:
            waits[j] -= 1
            if waits[j] == 0:
                ready.append(j)
    if seen != len(tasks):
        raise HetplanError(f"plan schedule {phase}: the tasks' queue order and edges form a cycle; "
                           f"recompile the plan")


def _check_slot_reuse(phase: str, tasks, deps: dict) -> None:
    """The executor orders two tasks only by an edge or by their lane's queue, so for consecutive
    loads L1, L2 into slot s, every op of L1's block that reads s must be an ancestor of L2 in
    deps + queue order; otherwise L2 may copy over weights a stage is still computing with."""
    before = {i: list(d) for i, d in deps.items()}
    last = {}
    for i, t in enumerate(tasks):
        if t.resource in last:
            before[i].append(last[t.resource])
        last[t.resource] = i
    previous = {}
    for i, t in enumerate(tasks):
        if t.kind != "load":
            continue
        earlier, previous[t.slot] = previous.get(t.slot), i
        if earlier is None:
            continue
        block = tasks[earlier].block
        readers = [j for j, r in enumerate(tasks) if r.block == block and r.slot == t.slot and r.kind != "load"]
        ancestors, stack = set(), [i]
        while stack:
            for j in before[stack.pop()]:
                if j not in ancestors:
                    ancestors.add(j)
                    stack.append(j)
        for j in readers:
            if j not in ancestors:
                raise HetplanError(f"plan schedule {phase}: {t.id} may overwrite staging slot {t.slot} while "
                                   f"{tasks[j].id} still reads it (no edge orders {tasks[j].id} before "
                                   f"{t.id}); recompile the plan")


def _device(t: Task) -> str:
    if t.kind in ("act_up", "load"):
        return "gpu"
    if t.kind in ("act_down", "kv_down"):
        return "cpu"
    return t.resource
