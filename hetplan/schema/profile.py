"""The node.profile.json schema: what ``hetplan profile`` writes and node.yaml's ``profile:``
points to.

Structure, types and ceilings: every key known at every depth, devices, ops and dtypes from
their lists, numbers finite and below what any machine reaches. Whether a value is possible on
the machine recorded (positive times, rates under that machine's physical peaks) is
``hetplan.profile.checks``'s job, which names the entry; whether the machine is this one too.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from hetplan.profile.table import DEVICES, OPS, SCHEMA_VERSION
from hetplan.schema.fields import (BYTES_MAX, FLOPS_MAX, MEM_BYTES_PER_S_MAX, SECONDS_MAX, Bytes, Strict, count,
                                   quantity)

Text = Annotated[str, Field(max_length=500)]
Seconds = Annotated[float, Field(le=SECONDS_MAX, json_schema_extra={"si": "s", "range": f"<= {SECONDS_MAX:g}"})]
"""A measured time: finite and below the ceiling here; positive is checked with the entry named."""


class Point(Strict):
    x: Annotated[float, Field(le=1e18, json_schema_extra={"range": "<= 1e18"})] = Field(
        description="size in the op's coordinate (rows, causal pairs, cached tokens; bytes for a transfer)")
    seconds: Seconds = Field(description="one task doing this op")
    spread_s: Seconds = Field(0.0, description="interquartile range of the repeats")
    repeats: count(10**9, 1) = Field(1, description="calls measured")
    flops: Annotated[float, Field(le=FLOPS_MAX * SECONDS_MAX)] = Field(0.0, description="FLOPs of one call")
    bytes: Annotated[float, Field(le=BYTES_MAX * 1e3)] = Field(0.0, description="bytes one call touches")
    source: Literal["measured", "trace"] = Field("measured", description="hetplan profile, or folded from a run")


class Entry(Strict):
    device: Literal[DEVICES] = Field(description="where it ran")
    op: Literal[OPS] = Field(description="the op measured")
    dtype: Literal["fp32", "bf16", "fp16", "int8", "int4", "q8_0", "q4_0", "q4_k_m"] = Field(
        description="compute dtype, or the packed weight format a quantised linear or stage was timed in")
    shape: Text = Field(description="weight or attention shape key (d768_f2048_silu_gated, ...)")
    points: Annotated[list[Point], Field(min_length=1)] = Field(description="one per size")


class MachineGpu(Strict):
    name: Text = Field(description="model name")
    memory_bytes: Bytes | None = Field(None, description="memory torch reports")
    mem_peak_bytes_per_s: quantity("bytes/s", 1e14) | None = Field(None, description="from clock and bus width")
    link_peak_bytes_per_s: quantity("bytes/s", 1e13) | None = Field(None, description="from PCIe generation and width")


class Machine(Strict):
    cpu_model: Text | None = Field(None, description="from /proc/cpuinfo")
    cpu_count: count(1 << 20) | None = Field(None, description="logical CPUs")
    memory_bytes: Annotated[int, Field(ge=0, le=2**50)] | None = Field(None, description="physical memory")
    gpus: Annotated[list[MachineGpu], Field(max_length=1024)] | None = Field(None, description="GPU models (none: unknown)")
    threads: count(1 << 20) | None = Field(None, description="torch threads while measuring")


def _node_path(key: str) -> str:
    import re

    if not re.fullmatch(r"(cpu|gpus\[\d+\]|links|latency)(\.[a-z0-9_]+)+", key):
        raise ValueError(f"key {key!r} is not a node.yaml path (cpu.mem_bandwidth, gpus[0].flops.bf16, "
                         f"links.h2d, latency.cpu_task, ...)")
    return key


class TaskOverhead(Strict):
    cpu: Seconds = Field(description="the runtime's cost of one CPU task")
    gpu: Seconds = Field(description="the runtime's cost of one GPU task")


class Info(Strict):
    threads: count(1 << 20) | None = Field(None, description="torch threads")
    torch: Text | None = Field(None, description="torch version")
    budget_s: quantity("s", SECONDS_MAX) | None = Field(None, description="--budget")
    elapsed_s: quantity("s", SECONDS_MAX) | None = Field(None, description="time measuring took")
    skipped: list[Annotated[str, Field(max_length=2000)]] | None = Field(None, description="what the budget left out")
    peaks: dict[Annotated[str, AfterValidator(_node_path)], float] | None = Field(
        None, description="node.yaml path -> measured SI value")
    task_overhead_s: TaskOverhead | None = Field(None, description="added to measured points")
    load_average_before: quantity("load", 1e6) | None = Field(None, description="1-minute load average")
    cpu_read_end_bytes_per_s: quantity("bytes/s", MEM_BYTES_PER_S_MAX) | None = Field(
        None, description="the CPU's streaming read measured again at the end (against cpu.mem_bandwidth: drift)")
    one_row_readings: count(1 << 20) | None = Field(
        None, description="times the models' stages at one row were timed, their repeats pooled")
    models: list[Text] | None = Field(None, description="models whose stages were measured")


class ProfileFile(Strict):
    schema_version: Literal[SCHEMA_VERSION] = Field(description="format version")
    machine: Machine = Field(default_factory=Machine, description="the machine measured")
    info: Info = Field(default_factory=Info, description="how it was measured")
    entries: list[Entry] = Field(default_factory=list, description="per-op measurements")
    transfers: dict[Literal["h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable"], list[Point]] = Field(
        default_factory=dict, description="copy times over bytes")


SECTIONS = (("", ProfileFile), ("machine", Machine), ("machine.gpus[]", MachineGpu), ("info", Info),
            ("info.task_overhead_s", TaskOverhead), ("entries[]", Entry),
            ("entries[].points[], transfers.*[]", Point))
"""Where each model sits in the file, for the README's key table."""
