"""Does this machine match the one a stage was planned on? Checked by each stage's process
before it loads any weight.

A stage's record (``pipeline.stages[i].plan``) holds the single-device machine it was planned
on (its ``hardware``: one GPU's name and memory, the node's CPU cores and memory) and what its
plan puts where (``memory``). What this process finds:

- a CUDA stage: its GPU (``torch.cuda.get_device_properties``). Total memory below the plan's
  GPU budget (``memory.gpu_budget_bytes``) cannot hold the stage: refused. Another name with
  enough memory runs, with a warning (the plan's times were priced for the other GPU).
- every stage: this host's physical memory (``os.sysconf``). Below what the stage's plan puts in
  DRAM (``memory.cpu_bytes``; with an emulated GPU, its bytes too, which live in host memory):
  refused.
- micro-batches beyond those the plan sized the stage's KV caches for (``pipeline.micro_batches``):
  each further one a KV cache more in each cache's tier (``extra_kv_bytes``). Beyond the stage's
  GPU budget (a CUDA or emulated GPU): refused, saying how many fit; in DRAM, counted in the
  host check above.

A refusal is one line naming the stage, what the plan expects, what was found and what to do.
Free memory at run time is checked later, when the stage is placed (``devices.check_free_memory``).
Knows nothing about messages between stages.
"""

from __future__ import annotations

import os

import torch

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.units import format_bytes


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def extra_kv_bytes(stage: Plan, micro_batches: int, planned: int = 1) -> dict:
    """Tier -> bytes of the KV caches of micro-batches beyond the ``planned`` ones the stage's
    plan holds: ``(M - planned) x`` one micro-batch's KV bytes in that tier (its placement's
    ``kv_bytes`` are ``planned`` micro-batches', in the tier its ``kv`` says); none when
    ``M <= planned``."""
    per = {"gpu": 0, "cpu": 0}
    for p in stage.placement:
        if p["kv"] is not None:
            per[p["kv"]] += int(p["kv_bytes"]) // planned
    return {t: max(0, micro_batches - planned) * b for t, b in per.items()}


def check_micro_batches(stage: Plan, name: str, mode: str, micro_batches: int, planned: int = 1) -> None:
    """Refuse ``micro_batches`` whose KV caches beyond the ``planned`` ones overflow the stage's
    GPU budget (a CUDA or emulated GPU; on the CPU alone the host check counts them)."""
    extra = extra_kv_bytes(stage, micro_batches, planned)
    if mode == "cpu" or not extra["gpu"]:
        return
    memory = stage.memory
    need, budget = memory["gpu_bytes"] + extra["gpu"], memory["gpu_budget_bytes"]
    if need > budget:
        per = extra["gpu"] // (micro_batches - planned)
        fit = planned + int((budget - memory["gpu_bytes"]) // per)
        raise HetplanError(f"{name}: --micro-batches {micro_batches}: the plan sized the stage's KV caches for "
                           f"{planned} micro-batch(es); with one cache per micro-batch it takes {format_bytes(need)} "
                           f"of GPU memory, over its budget of {format_bytes(budget)}; run at most {fit} "
                           f"micro-batch(es), or recompile with a smaller --batch")


def check_node(stage: Plan, rank: int, mode: str, gpu: int, micro_batches: int = 1, planned: int = 1,
               name: str | None = None) -> list:
    """Refuse (HetplanError) stage ``rank``'s plan (``stage``: ``record.stage_plan``) on this
    machine when it cannot hold it, run with ``micro_batches`` where its KV caches are sized for
    ``planned``; -> warning lines (each naming the stage) when it can but differs.
    ``mode``/``gpu``: how and where the stage runs here (``worker.stage_device``); ``name``: how
    the process is named (default ``stage RANK``)."""
    name, hw, memory = name or f"stage {rank}", stage.hardware, stage.memory
    check_micro_batches(stage, name, mode, micro_batches, planned)
    extra = extra_kv_bytes(stage, micro_batches, planned)
    where = f"the plan was made for {hw.name!r}"
    warnings = []
    if mode == "cuda":
        planned, props = hw.gpus[0], torch.cuda.get_device_properties(gpu)
        budget = memory["gpu_budget_bytes"]
        if props.total_memory < budget:
            raise HetplanError(
                f"{name}: {where}, whose GPU ({planned.name}, {format_bytes(planned.memory_bytes)}) the stage may "
                f"fill with {format_bytes(budget)}, but GPU {gpu} here ({props.name}) has "
                f"{format_bytes(props.total_memory)} in all; run this stage on a node with such a GPU, or "
                f"recompile for this node's GPUs")
        if props.name != planned.name:
            warnings.append(f"{name}: {where} with GPU {planned.name!r}, but GPU {gpu} here is {props.name!r}; it "
                            f"runs (its {format_bytes(props.total_memory)} hold the stage's budget), but the plan's "
                            f"times are that GPU's")
    dram = memory["cpu_bytes"] + extra["cpu"] + (memory["gpu_bytes"] + extra["gpu"] if mode == "emulated" else 0)
    host = host_memory_bytes()
    if host < dram:
        what = "in DRAM" + (" (its CPU blocks and the emulated GPU)" if mode == "emulated" else "")
        raise HetplanError(
            f"{name}: {where} with {format_bytes(hw.cpu.memory_bytes)} of host memory, and puts "
            f"{format_bytes(dram)} of the stage {what}, but this machine has {format_bytes(host)} in all; run "
            f"this stage on a node with at least {format_bytes(dram)}, or recompile for this node")
    return warnings
