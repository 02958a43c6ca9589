"""HardwareSpec: a machine's memories, bandwidths, FLOP peaks and links, read from node.yaml.

All values are SI numbers (bytes, bytes/s, FLOP/s, seconds) once parsed; ``units`` does the
parsing at this edge. Knows nothing about models or plans. A node with no GPU is valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hetplan.errors import HetplanError
from hetplan.units import parse_bandwidth, parse_bytes, parse_flops

DEFAULT_EFFICIENCY = {"gpu_mem": 0.85, "cpu_mem": 0.7, "link": 0.9, "gpu_flops": 0.7, "cpu_flops": 0.5}
DEFAULT_LATENCY_S = {"gpu_task": 20e-6, "cpu_task": 20e-6, "link_task": 10e-6}
"""Fixed cost of one task on each kind of resource (kernel launches, dispatch, DMA setup)."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    mem_bytes_per_s: float
    flops_per_s: dict
    """Peak FLOP/s by compute dtype (``fp32``, ``fp16``, ``bf16``)."""
    cores: int = 0

    def peak_flops(self, dtype: str) -> float:
        """Peak for ``dtype``; bf16 falls back to fp16 and vice versa, then to fp32."""
        for key in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype), "fp32"):
            if key in self.flops_per_s:
                return self.flops_per_s[key]
        return max(self.flops_per_s.values())


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    gpus: tuple
    cpu: DeviceSpec
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    gpu_reserve_bytes: int = 1 << 30
    cpu_reserve_bytes: int = 4 << 30
    efficiency: dict = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    latency_s: dict = field(default_factory=lambda: dict(DEFAULT_LATENCY_S))
    price_per_hour: float | None = None
    profile: str | None = None
    """Path of a measured per-op profile (node.profile.json), relative to the node.yaml."""

    @property
    def gpu(self) -> DeviceSpec | None:
        """The GPU plans use (the first listed); None on a CPU-only node."""
        return self.gpus[0] if self.gpus else None

    def gpu_budget_bytes(self) -> int:
        return max(0, self.gpu.memory_bytes - self.gpu_reserve_bytes) if self.gpu else 0

    def cpu_budget_bytes(self) -> int:
        return max(0, self.cpu.memory_bytes - self.cpu_reserve_bytes)

    def with_budgets(self, gpu_mem: int | None = None, cpu_mem: int | None = None) -> "HardwareSpec":
        """Override usable memory: the budget becomes exactly ``gpu_mem``/``cpu_mem`` bytes."""
        hw = self
        if gpu_mem is not None:
            if not hw.gpu:
                raise HetplanError("--gpu-mem: this node has no GPU")
            gpu = dataclasses.replace(hw.gpu, memory_bytes=gpu_mem + hw.gpu_reserve_bytes)
            hw = dataclasses.replace(hw, gpus=(gpu,) + hw.gpus[1:])
        if cpu_mem is not None:
            hw = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, memory_bytes=cpu_mem + hw.cpu_reserve_bytes))
        return hw

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        d = dict(d)
        d["gpus"] = tuple(DeviceSpec(**g) for g in d["gpus"])
        d["cpu"] = DeviceSpec(**d["cpu"])
        return cls(**d)


# -- node.yaml ---------------------------------------------------------------------------------

_TOP_KEYS = {"name", "gpus", "cpu", "links", "reserve", "efficiency", "latency", "price", "profile"}


def parse_node(raw: dict, source: str = "node.yaml") -> HardwareSpec:
    """Validate and convert a node.yaml mapping (units as strings) to a HardwareSpec."""
    if not isinstance(raw, dict):
        raise HetplanError(f"{source}: expected a mapping at the top level")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise HetplanError(f"{source}: unknown keys {sorted(unknown)}; accepted: {sorted(_TOP_KEYS)}")

    def need(d, key, where):
        if not isinstance(d, dict) or key not in d:
            raise HetplanError(f"{source}: missing key '{where}{key}'")
        return d[key]

    def device(d, where) -> DeviceSpec:
        flops = need(d, "flops", where)
        if not isinstance(flops, dict) or not flops:
            raise HetplanError(f"{source}: '{where}flops' must map dtypes to rates, e.g. {{fp16: 165TFLOPS}}")
        cores = d.get("cores", 0)
        if not isinstance(cores, int) or cores < 0:
            raise HetplanError(f"{source}: '{where}cores' must be a non-negative integer")
        return DeviceSpec(name=str(d.get("name", where.rstrip("."))),
                          memory_bytes=parse_bytes(need(d, "memory", where), f"{source}: {where}memory"),
                          mem_bytes_per_s=parse_bandwidth(need(d, "mem_bandwidth", where),
                                                          f"{source}: {where}mem_bandwidth"),
                          flops_per_s={k: parse_flops(v, f"{source}: {where}flops.{k}") for k, v in flops.items()},
                          cores=cores)

    gpus_raw = raw.get("gpus") or []
    if not isinstance(gpus_raw, list):
        raise HetplanError(f"{source}: 'gpus' must be a list")
    gpus = tuple(device(g, f"gpus[{i}].") for i, g in enumerate(gpus_raw))
    cpu = device(need(raw, "cpu", ""), "cpu.")
    links = raw.get("links") or {}
    if gpus and not links:
        raise HetplanError(f"{source}: missing key 'links' (h2d and d2h bandwidth, e.g. h2d: 25GB/s)")
    h2d = parse_bandwidth(need(links, "h2d", "links."), f"{source}: links.h2d") if gpus else 1.0
    d2h = parse_bandwidth(links.get("d2h", links.get("h2d")), f"{source}: links.d2h") if gpus else 1.0
    reserve = raw.get("reserve") or {}
    eff = dict(DEFAULT_EFFICIENCY)
    for k, v in (raw.get("efficiency") or {}).items():
        if k not in DEFAULT_EFFICIENCY:
            raise HetplanError(f"{source}: unknown key 'efficiency.{k}'; accepted: {sorted(DEFAULT_EFFICIENCY)}")
        if not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise HetplanError(f"{source}: 'efficiency.{k}' must be a number in (0, 1], got {v!r}")
        eff[k] = float(v)
    lat = dict(DEFAULT_LATENCY_S)
    for k, v in (raw.get("latency") or {}).items():
        if k not in DEFAULT_LATENCY_S:
            raise HetplanError(f"{source}: unknown key 'latency.{k}'; accepted: {sorted(DEFAULT_LATENCY_S)}")
        if not isinstance(v, (int, float)) or v < 0:
            raise HetplanError(f"{source}: 'latency.{k}' must be seconds >= 0, got {v!r}")
        lat[k] = float(v)
    price = raw.get("price")
    per_hour = None
    if price is not None:
        per_hour = need(price, "per_hour", "price.")
        if not isinstance(per_hour, (int, float)) or per_hour <= 0:
            raise HetplanError(f"{source}: 'price.per_hour' must be a positive number")
    return HardwareSpec(
        name=str(raw.get("name", Path(source).stem)), gpus=gpus, cpu=cpu, h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        gpu_reserve_bytes=parse_bytes(reserve["gpu"], f"{source}: reserve.gpu") if "gpu" in reserve else 1 << 30,
        cpu_reserve_bytes=parse_bytes(reserve["cpu"], f"{source}: reserve.cpu") if "cpu" in reserve else 4 << 30,
        efficiency=eff, latency_s=lat, price_per_hour=float(per_hour) if per_hour else None,
        profile=str(raw["profile"]) if raw.get("profile") else None)


def load_node(source: str) -> HardwareSpec:
    """A node preset name or a node.yaml path -> HardwareSpec."""
    from hetplan.presets.nodes import NODE_PRESETS

    if source in NODE_PRESETS:
        return parse_node(yaml.safe_load(NODE_PRESETS[source]), source=f"preset {source}")
    p = Path(source)
    if not p.is_file():
        raise HetplanError(f"--hw {source!r}: not a preset and no such file; known presets: "
                           f"{', '.join(sorted(NODE_PRESETS))} (or pass a node.yaml path)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise HetplanError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    hw = parse_node(raw, source=str(p))
    if hw.profile and not Path(hw.profile).is_absolute():
        hw = dataclasses.replace(hw, profile=str(p.parent / hw.profile))
    return hw
