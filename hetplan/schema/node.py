"""The node.yaml schema: every accepted key, its unit, its physical range and its default.

One pydantic model per mapping, strict: an unknown key at any depth is refused with the accepted
keys listed, a size or rate must carry its unit (``24GiB``, ``25GB/s``, ``165TFLOPS``), and each
value must be physically possible (no GPU larger than any sold, no link faster than any built).
``node_keys_table`` renders the same models as the README's key table, so the two cannot drift.
Knows nothing about planning: ``hetplan.hardware`` turns a validated ``Node`` into a
HardwareSpec.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from hetplan.schema.errors import fields_of
from hetplan.schema.fields import Text
from hetplan.units import format_bytes, quantity

_GB, _TB = 1e9, 1e12


def _unit(what: str, low: float, high: float, why: str, zero_ok: bool = False):
    """A quantity with a unit (``units.quantity``) in ``[low, high]``; ``why`` says what the upper
    bound is (shown in errors and in the README table)."""
    def check(v):
        if zero_ok and isinstance(v, str) and re.fullmatch(r"\s*0*\.?0+\s*(Ki|Mi|Gi|Ti|Pi|[kKMGTP])?B\s*", v):
            return 0.0
        x = quantity(v, what)
        if x < low:
            raise ValueError(f"{v!r} is below {_show(what, low)}, the smallest plausible value")
        if x > high:
            raise ValueError(f"{v!r} is above {_show(what, high)}: {why}")
        return x
    return Annotated[float, BeforeValidator(check),
                     Field(json_schema_extra={"unit": what, "range": f"{_show(what, low)} .. {_show(what, high)}"})]


def _show(what: str, x: float) -> str:
    if what == "a size":
        return format_bytes(x).replace(" ", "")
    if what == "a bandwidth":
        return f"{x / _TB:g}TB/s" if x >= _TB else f"{x / _GB:g}GB/s" if x >= _GB else f"{x / 1e6:g}MB/s"
    return f"{x / 1e15:g}PFLOPS" if x >= 1e15 else f"{x / _TB:g}TFLOPS" if x >= _TB else f"{x / 1e6:g}MFLOPS"


GpuMemory = _unit("a size", 2**20, 2**40, "no GPU sold holds more than 288 GB")
CpuMemory = _unit("a size", 2**20, 2**46, "larger than any single machine's DRAM (64 TiB)")
Reserve = _unit("a size", 0, 2**46, "larger than any machine's memory", zero_ok=True)
MemBandwidth = _unit("a bandwidth", 1e6, 20 * _TB, "no memory is faster than about 8 TB/s (HBM3e)")
LinkBandwidth = _unit("a bandwidth", 1e6, 2 * _TB, "no CPU-GPU link is faster than about 900 GB/s "
                      "(NVLink-C2C); PCIe 5.0 x16 is 64 GB/s")
FlopRate = _unit("a FLOP rate", 1e6, 1e17, "no device computes more than about 20 PFLOPS dense")
def _yaml11_float(v):
    """YAML 1.1 (PyYAML) reads ``5e-6`` (an exponent without a dot) as a string: take it as the
    number it is written as. Anything else that is not a number is left for the type check."""
    if isinstance(v, str) and _FLOAT.fullmatch(v.strip()):
        return float(v)
    return v


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
Fraction = Annotated[float, BeforeValidator(_yaml11_float), Field(gt=0, le=1, json_schema_extra={"range": "(0, 1]"})]
TaskSeconds = Annotated[float, BeforeValidator(_yaml11_float),
                        Field(ge=0, le=1, json_schema_extra={"range": "0 .. 1 s"})]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Flops(_Strict):
    """Peak FLOP/s by compute dtype; at least one of fp32, fp16, bf16 (the dtypes plans compute in)."""
    fp32: FlopRate | None = Field(None, description="peak fp32 rate")
    tf32: FlopRate | None = Field(None, description="peak tf32 tensor rate (recorded, not planned with)")
    fp16: FlopRate | None = Field(None, description="peak fp16 rate (bf16 falls back to it)")
    bf16: FlopRate | None = Field(None, description="peak bf16 rate (fp16 falls back to it)")
    fp8: FlopRate | None = Field(None, description="peak fp8 rate (recorded, not planned with)")
    int8: FlopRate | None = Field(None, description="peak int8 rate (recorded, not planned with)")

    @model_validator(mode="after")
    def _planned_dtype(self):
        if self.fp32 is None and self.fp16 is None and self.bf16 is None:
            raise ValueError("needs a rate for fp32, fp16 or bf16 (plans compute in those; fp8/int8 "
                             "rates are not used for them), e.g. {bf16: 165TFLOPS, fp32: 82TFLOPS}")
        return self


class Gpu(_Strict):
    name: Text = Field("gpu", description="shown in plans")
    device_class: Literal["consumer", "datacenter"] = Field(
        "consumer", alias="class", description="consumer (GeForce, laptop) or datacenter (T4, A100, H100): "
        "selects the default `gpu_*` efficiencies and latency")
    memory: GpuMemory = Field(description="total HBM; the reserve is subtracted")
    mem_bandwidth: MemBandwidth = Field(description="HBM bandwidth")
    flops: Flops = Field(description="peak rates by dtype")
    cores: Annotated[int, Field(ge=0, le=100000)] = Field(0, description="SMs (recorded, not planned with)")
    numa: Annotated[int, Field(ge=0, le=63)] | None = Field(
        None, description="the CPU socket (NUMA node) whose DRAM and PCIe root the GPU hangs off "
        "(recorded, not planned with)")


class Cpu(_Strict):
    name: Text = Field("cpu", description="shown in plans")
    device_class: Literal["desktop", "server"] = Field(
        "desktop", alias="class", description="desktop (dual-channel DRAM) or server (Xeon, EPYC; "
        "several channels or sockets): selects the default `cpu_*` efficiencies and latency")
    cores: Annotated[int, Field(ge=0, le=4096)] = Field(0, description="physical cores")
    sockets: Annotated[int, Field(ge=1, le=64)] = Field(1, description="CPU sockets (NUMA nodes); "
                                                         "a GPU's `numa` names one of them")
    memory: CpuMemory = Field(description="total DRAM; the reserve is subtracted")
    mem_bandwidth: MemBandwidth = Field(description="DRAM bandwidth (STREAM-class)")
    flops: Flops = Field(description="peak rates by dtype")


class Links(_Strict):
    h2d: LinkBandwidth = Field(description="pinned host-to-device copy bandwidth")
    d2h: LinkBandwidth | None = Field(None, description="device-to-host; defaults to h2d")


PeerBandwidth = _unit("a bandwidth", 1e6, 2 * _TB, "no GPU-GPU link is faster than about 900 GB/s "
                      "per direction (NVLink 5)")


class Peer(_Strict):
    """How two GPUs (or every pair, ``between: all``) exchange activations: NVLink or NVSwitch,
    PCIe peer-to-peer, or through host memory (a copy out over d2h and back in over h2d). A
    pair no entry names goes through the host."""
    between: Annotated[list[Annotated[int, Field(ge=0, le=1023)]], Field(min_length=2, max_length=2)] | Literal["all"] = Field(
        description="two indices into `gpus` (`[0, 1]`), or `all` for every pair")
    kind: Literal["nvlink", "nvswitch", "pcie", "host"] = Field(
        description="nvlink / nvswitch / pcie (peer-to-peer), or host (staged through DRAM)")
    bandwidth: PeerBandwidth | None = Field(None, description="one direction's bandwidth; required "
                                            "unless kind is host")

    @model_validator(mode="after")
    def _bandwidth_given(self):
        if self.kind != "host" and self.bandwidth is None:
            raise ValueError(f"a {self.kind} link needs a bandwidth (e.g. bandwidth: 25GB/s)")
        if self.kind == "host" and self.bandwidth is not None:
            raise ValueError("a host link takes no bandwidth: it is priced over links.d2h and links.h2d")
        if isinstance(self.between, list) and self.between[0] == self.between[1]:
            raise ValueError(f"between: {self.between} names one GPU twice; a link joins two GPUs")
        return self


class Reserves(_Strict):
    gpu: Reserve = Field(float(1 << 30), description="GPU memory kept free (CUDA context, fragmentation)")
    cpu: Reserve = Field(float(4 << 30), description="DRAM kept free (OS, the runtime itself)")


BY_CLASS = {"default": "by class"}
"""README default of a constant that comes from the device class (``hetplan.presets.device_classes``)."""


class Efficiency(_Strict):
    gpu_mem: Fraction | None = Field(None, description="achieved / peak HBM bandwidth", json_schema_extra=BY_CLASS)
    cpu_mem: Fraction | None = Field(None, description="achieved / peak DRAM bandwidth", json_schema_extra=BY_CLASS)
    link: Fraction | None = Field(None, description="achieved / stated link bandwidth", json_schema_extra=BY_CLASS)
    gpu_flops: Fraction | None = Field(None, description="achieved / peak GPU FLOP/s", json_schema_extra=BY_CLASS)
    cpu_flops: Fraction | None = Field(None, description="achieved / peak CPU FLOP/s", json_schema_extra=BY_CLASS)


class Latency(_Strict):
    gpu_task: TaskSeconds | None = Field(None, description="fixed cost of one GPU task, seconds",
                                         json_schema_extra=BY_CLASS)
    cpu_task: TaskSeconds | None = Field(None, description="fixed cost of one CPU task, seconds",
                                         json_schema_extra=BY_CLASS)
    link_task: TaskSeconds | None = Field(None, description="fixed cost of one copy (and the synchronisation "
                                          "around it), seconds", json_schema_extra=BY_CLASS)


class Price(_Strict):
    per_hour: Annotated[float, Field(gt=0, le=10000)] = Field(description="machine cost per hour")


class Node(_Strict):
    name: Text | None = Field(None, description="shown in plans (default: the file's name)")
    gpus: list[Gpu] = Field(default_factory=list, description="empty or absent: a CPU-only node; "
                            "with several, plans run them as pipeline stages")
    cpu: Cpu = Field(description="the host")
    links: Links | None = Field(None, description="required when there is a GPU")
    peers: list[Peer] = Field(default_factory=list, description="GPU-to-GPU links (several GPUs); "
                              "a pair not listed goes through the host")
    reserve: Reserves = Field(default_factory=Reserves, description="memory kept free per tier")
    efficiency: Efficiency = Field(default_factory=Efficiency, description="achieved fraction of each peak")
    latency: Latency = Field(default_factory=Latency, description="per-task fixed costs")
    price: Price | None = Field(None, description="`show` then reports tokens per dollar")
    profile: Text | None = Field(None, description="node.profile.json path, relative to this file")

    @model_validator(mode="after")
    def _consistent(self):
        if self.gpus and self.links is None:
            raise ValueError("a node with a GPU needs 'links' (e.g. links: {h2d: 25GB/s})")
        smallest = min((g.memory for g in self.gpus), default=None)
        if self.gpus and self.reserve.gpu >= smallest:
            raise ValueError(f"reserve.gpu ({format_bytes(self.reserve.gpu)}) leaves nothing of the GPU's "
                             f"{format_bytes(smallest)}; lower it")
        for i, peer in enumerate(self.peers):
            for g in peer.between if isinstance(peer.between, list) else ():
                if g >= len(self.gpus):
                    raise ValueError(f"peers[{i}].between names GPU {g}, but the node lists "
                                     f"{len(self.gpus)} GPU(s) (indices 0..{len(self.gpus) - 1}); "
                                     f"fix the index or add the GPU to 'gpus'")
        for i, g in enumerate(self.gpus):
            if g.numa is not None and g.numa >= self.cpu.sockets:
                raise ValueError(f"gpus[{i}].numa is {g.numa}, but cpu.sockets is {self.cpu.sockets} "
                                 f"(sockets 0..{self.cpu.sockets - 1}); fix numa or set cpu.sockets")
        if self.reserve.cpu >= self.cpu.memory:
            raise ValueError(f"reserve.cpu ({format_bytes(self.reserve.cpu)}) leaves nothing of the CPU's "
                             f"{format_bytes(self.cpu.memory)}; lower it")
        return self


SECTIONS = (("", Node), ("gpus[]", Gpu), ("cpu", Cpu), ("*.flops", Flops), ("links", Links), ("peers[]", Peer),
            ("reserve", Reserves), ("efficiency", Efficiency), ("latency", Latency), ("price", Price))
"""Where each model sits in a node.yaml (``gpus[]``: every item of the list)."""


def submodel(model: type, key) -> type | None:
    """The model of ``model``'s field ``key`` (through lists and optionals), or None."""
    field = fields_of(model).get(key) if isinstance(key, str) else None
    return None if field is None else submodel_type(field.annotation)


def submodel_type(annotation) -> type | None:
    """The pydantic model inside ``annotation`` (through lists, optionals, Annotated), or None."""
    stack = [annotation]
    while stack:
        t = stack.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
        stack.extend(typing.get_args(t))
    return None


def _extra(field) -> dict:
    """The ``json_schema_extra`` of a field and of the Annotated types inside its annotation."""
    extra = dict(field.json_schema_extra or {})
    metadata = list(field.metadata)
    stack = [field.annotation]
    while stack:
        t = stack.pop()
        if typing.get_origin(t) is Annotated:
            metadata += list(t.__metadata__)
        stack.extend(typing.get_args(t))
    for m in metadata:
        extra.update(getattr(m, "json_schema_extra", None) or {})
    return extra


def _type_of(name: str, field) -> str:
    extra = _extra(field)
    if "unit" in extra:
        return {"a size": "size (`24GiB`)", "a bandwidth": "rate (`25GB/s`)",
                "a FLOP rate": "rate (`165TFLOPS`)"}[extra["unit"]]
    t = field.annotation
    if typing.get_origin(t) is list:
        return "list"
    if typing.get_origin(t) is Literal:
        return "one of " + ", ".join(typing.get_args(t))
    if submodel_type(t) is not None:
        return "mapping"
    names = {int: "integer", float: "number", str: "string"}
    plain = {typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in (t, *typing.get_args(t))}
    for cand, label in names.items():
        if cand in plain:
            return label
    if typing.get_origin(t) is list:
        return "list"
    return "mapping"


def range_of(field) -> str:
    """A field's accepted range as the README shows it ('(0, 1]', '1GB/s .. 20TB/s')."""
    extra = _extra(field)
    if "range" in extra:
        return extra["range"]
    bounds = [(getattr(m, a), sym) for m in field.metadata
              for a, sym in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if getattr(m, a, None) is not None]
    return ", ".join(f"{sym} {v:g}" for v, sym in bounds)


def _default_of(field) -> str:
    if field.is_required():
        return "required"
    if "default" in _extra(field):
        return _extra(field)["default"]
    if field.default_factory is not None or field.default is None:
        return ""
    d = field.default
    if isinstance(d, float) and d >= 2**20:
        return format_bytes(d).replace(" ", "")
    return f"{d:g}" if isinstance(d, float) else str(d)


def node_keys_table() -> str:
    """The README's node.yaml key table, generated from the models above."""
    lines = ["| key | type | range | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for prefix, model in SECTIONS:
        for name, field in fields_of(model).items():
            key = f"{prefix}.{name}" if prefix else name
            lines.append(f"| `{key}` | {_type_of(name, field)} | {range_of(field)} | {_default_of(field)} | "
                         f"{field.description or ''} |")
    return "\n".join(lines) + "\n"
