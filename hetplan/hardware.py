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
from hetplan.files import BoundedLoader
from pydantic import ValidationError

from hetplan.presets.device_classes import class_defaults
from hetplan.schema.node import Node
from hetplan.schema.errors import schema_error

DEFAULT_EFFICIENCY, DEFAULT_LATENCY_S = class_defaults()
"""The constants of a consumer GPU on a desktop CPU (``hetplan.presets.device_classes``): achieved
fractions of each peak, and the fixed cost of one task on each kind of resource (kernel
launches, dispatch, DMA setup and the synchronisation around a copy)."""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: int
    mem_bytes_per_s: float
    flops_per_s: dict
    """Peak FLOP/s by compute dtype (``fp32``, ``fp16``, ``bf16``)."""
    cores: int = 0
    device_class: str = ""
    """consumer / datacenter (GPU), desktop / server (CPU): where the default constants came from."""
    numa: int | None = None
    """The CPU socket a GPU hangs off (None: not stated)."""

    def peak_flops(self, dtype: str) -> float:
        """Peak for ``dtype``; bf16 falls back to fp16 and vice versa, then to fp32, then to the
        fastest of fp32/fp16/bf16 (never to an fp8 or int8 rate)."""
        for key in (dtype, {"bf16": "fp16", "fp16": "bf16"}.get(dtype, dtype), "fp32"):
            if key in self.flops_per_s:
                return self.flops_per_s[key]
        planned = [v for k, v in self.flops_per_s.items() if k in ("fp32", "fp16", "bf16")]
        return max(planned or self.flops_per_s.values())


@dataclass(frozen=True)
class PeerLink:
    """How GPUs ``a`` and ``b`` (indices into ``HardwareSpec.gpus``) exchange activations."""
    a: int
    b: int
    kind: str
    """nvlink, nvswitch, pcie (peer-to-peer) or host (through DRAM)."""
    bytes_per_s: float | None = None
    """One direction's bandwidth; None for host (priced over d2h then h2d)."""


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
    peers: tuple = ()
    """PeerLinks between GPUs; a pair not listed goes through the host."""

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

    def peer(self, a: int, b: int) -> PeerLink:
        """The link between GPUs ``a`` and ``b`` (the last entry naming the pair wins), or a
        host link when none does."""
        found = PeerLink(a, b, "host")
        for link in self.peers:
            if {link.a, link.b} == {a, b}:
                found = link
        return found

    def single_gpu(self, k: int) -> "HardwareSpec":
        """This node with GPU ``k`` as its only GPU: what one pipeline stage is planned on."""
        return dataclasses.replace(self, gpus=(self.gpus[k],), peers=())

    def to_dict(self) -> dict:
        """As a plan records it; the multi-GPU keys (``peers``, a GPU's ``numa``) only where set,
        so single-GPU plans read as before."""
        d = dataclasses.asdict(self)
        if not d["peers"]:
            d.pop("peers")
        for dev in [*d["gpus"], d["cpu"]]:
            if dev["numa"] is None:
                dev.pop("numa")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        d = dict(d)
        d["gpus"] = tuple(DeviceSpec(**g) for g in d["gpus"])
        d["cpu"] = DeviceSpec(**d["cpu"])
        d["peers"] = tuple(PeerLink(**p) for p in d.get("peers", ()))
        return cls(**d)


# -- node.yaml ---------------------------------------------------------------------------------

def parse_node(raw, source: str = "node.yaml", text: str | None = None) -> HardwareSpec:
    """Validate a node.yaml mapping against ``hetplan.schema.node.Node`` and convert it to a HardwareSpec;
    ``text`` (the file's YAML) gives errors their line numbers."""
    if not isinstance(raw, dict):
        raise HetplanError(f"{source}: expected a mapping of keys (name, gpus, cpu, links, ...) at the "
                           f"top level, got {type(raw).__name__}")
    try:
        node = Node.model_validate(raw)
    except ValidationError as e:
        raise schema_error(e, Node, source, text) from None

    def device(d) -> DeviceSpec:
        flops = {k: v for k, v in d.flops.model_dump().items() if v is not None}
        return DeviceSpec(name=d.name, memory_bytes=int(round(d.memory)), mem_bytes_per_s=d.mem_bandwidth,
                          flops_per_s=flops, cores=d.cores, device_class=d.device_class,
                          numa=getattr(d, "numa", None))

    def peers(p) -> tuple:
        pairs = ([(a, b) for a in range(len(node.gpus)) for b in range(a + 1, len(node.gpus))]
                 if p.between == "all" else [tuple(p.between)])
        return tuple(PeerLink(a, b, p.kind, p.bandwidth) for a, b in pairs)

    links = node.links
    efficiency, latency = class_defaults(node.gpus[0].device_class if node.gpus else "consumer",
                                         node.cpu.device_class)
    efficiency.update({k: v for k, v in node.efficiency.model_dump().items() if v is not None})
    latency.update({k: v for k, v in node.latency.model_dump().items() if v is not None})
    return HardwareSpec(
        name=node.name if node.name is not None else Path(source).stem,
        gpus=tuple(device(g) for g in node.gpus), cpu=device(node.cpu),
        h2d_bytes_per_s=links.h2d if links else 1.0,
        d2h_bytes_per_s=(links.d2h or links.h2d) if links else 1.0,
        gpu_reserve_bytes=int(round(node.reserve.gpu)), cpu_reserve_bytes=int(round(node.reserve.cpu)),
        efficiency=efficiency, latency_s=latency,
        price_per_hour=node.price.per_hour if node.price else None, profile=node.profile,
        peers=tuple(link for p in node.peers for link in peers(p)))


def load_node(source: str) -> HardwareSpec:
    """A node preset name or a node.yaml path -> HardwareSpec."""
    from hetplan.presets.nodes import NODE_PRESETS

    if source in NODE_PRESETS:
        text = NODE_PRESETS[source]
        return parse_node(yaml.safe_load(text), source=f"preset {source}", text=text)
    p = Path(source)
    if p.exists() and not p.is_file():
        from hetplan.files import kind_of
        raise HetplanError(f"--hw {source!r}: is {kind_of(p.stat().st_mode)}, not a node.yaml; give a node.yaml "
                           f"path or a preset")
    if not p.is_file():
        raise HetplanError(f"--hw {source!r}: not a preset and no such file; known presets: "
                           f"{', '.join(sorted(NODE_PRESETS))} (or pass a node.yaml path)")
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as e:
        raise HetplanError(f"{p}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise HetplanError(f"{p}: not a text file (not UTF-8); expected a node.yaml") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise HetplanError(f"{where}: malformed YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise HetplanError(f"{p}: YAML nested too deeply to be a node.yaml") from None
    hw = parse_node(raw, source=str(p), text=text)
    if hw.profile and not Path(hw.profile).is_absolute():
        hw = dataclasses.replace(hw, profile=str(p.parent / hw.profile))
    return hw


class _UniqueKeyLoader(BoundedLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for k, _ in node.value:
            key = self.construct_object(k, deep=deep)
            try:
                dup = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, "a mapping key must be a plain value",
                                                        k.start_mark) from None
            if dup:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", k.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
