"""The part of a stage's plan its process runs, and where its layers sit in the whole model.

A stage's plan (``hetplan.pipeline.record.stage_plan``) numbers its layers from 0 and keeps the
embedding and the head as free blocks (no bytes, no time) in every stage. Its process runs the
same plan with:

- the embedding only in the first stage and the head only in the last: the others' rows and
  tasks are dropped, and the edges through a dropped task are kept as edges around it (from each
  of its predecessors, by edge or by queue, to each of its successors), so no order is lost;
  a middle stage's program then reads the hidden state ``x`` and writes it;
- each layer's index shifted to its place in the whole model (``layer + first``), and its blocks
  named after it (``attn_1`` of a stage from layer 2 is ``attn_3``, in the placement, the tasks
  and their ids), so weights are read by their checkpoint names and messages name the model's
  blocks; and the whole model's spec for the backend.

Pure Python over the plan: no torch, no devices.
"""

from __future__ import annotations

import dataclasses

from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.plan.format import PhaseSchedule


def stage_part(stage: Plan, model: ModelSpec, first: int, end: int) -> Plan:
    """``stage`` (layers ``[first, end)`` of ``model``, numbered from 0) as its process runs it."""
    drop = ({"embed"} if first > 0 else set()) | ({"head"} if end < model.n_layers else set())
    names = {p["block"]: _renamed(p["block"], p["layer"], first) for p in stage.placement if p["layer"] is not None}
    placement = tuple(p if p["layer"] is None else dict(p, block=names[p["block"]], layer=p["layer"] + first)
                      for p in stage.placement if p["block"] not in drop)
    schedule = {ph: renamed_blocks(without_blocks(s, drop), names) for ph, s in stage.schedule.items()}
    return dataclasses.replace(stage, model=model, placement=placement, schedule=schedule)


def _renamed(block: str, layer: int, first: int) -> str:
    """``attn_1`` of layer 1 -> ``attn_{1 + first}``; a name that does not end in its layer is kept."""
    head, _, tail = block.rpartition("_")
    return f"{head}_{layer + first}" if head and tail == str(layer) else block


def renamed_blocks(schedule: PhaseSchedule, names: dict) -> PhaseSchedule:
    """``schedule`` with blocks renamed by ``names`` (old -> new), in each task's block and in the
    last part of its id (a task's id ends in its block: ``mlp/mlp_1``, ``act_up/attn_in/attn_1``)."""
    ids, tasks = {}, []
    for t in schedule.tasks:
        new = names.get(t.block, t.block)
        head, _, last = t.id.rpartition("/")
        ids[t.id] = f"{head}/{new}" if last == t.block and head else t.id
        tasks.append(dataclasses.replace(t, id=ids[t.id], block=new))
    return PhaseSchedule(tuple(tasks), tuple((ids[a], ids[b]) for a, b in schedule.edges))


def without_blocks(schedule: PhaseSchedule, drop: set) -> PhaseSchedule:
    """``schedule`` without the tasks of the blocks in ``drop``; for each dropped task, its
    predecessors (edges into it, and the task before it on its resource) are joined to its
    successors (edges out of it, and the task after it on its resource)."""
    tasks = schedule.tasks
    before, after = {t.id: set() for t in tasks}, {t.id: set() for t in tasks}
    for src, dst in schedule.edges:
        before[dst].add(src)
        after[src].add(dst)
    prev, nxt, last = {}, {}, {}
    for t in tasks:
        prev[t.id] = last.get(t.resource)
        if prev[t.id] is not None:
            nxt[prev[t.id]] = t.id
        last[t.resource] = t.id
    for t in tasks:
        if t.block not in drop:
            continue
        p_lane, n_lane = prev.pop(t.id), nxt.pop(t.id, None)
        preds = before.pop(t.id) | ({p_lane} if p_lane else set())
        succs = after.pop(t.id) | ({n_lane} if n_lane else set())
        if n_lane:                      # its queue closes up around it
            prev[n_lane] = p_lane
        if p_lane:
            if n_lane:
                nxt[p_lane] = n_lane
            else:
                nxt.pop(p_lane, None)
        for p in preds:
            after[p].discard(t.id)
            after[p] |= succs - {p}
        for s in succs:
            before[s].discard(t.id)
            before[s] |= preds - {s}
    kept = tuple(t for t in tasks if t.block not in drop)
    return PhaseSchedule(kept, tuple((t.id, dst) for t in kept for dst in sorted(after[t.id])))
