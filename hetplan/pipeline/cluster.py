"""cluster.yaml: several nodes and the network between them -> a ``Topology`` the pipeline
planner spreads stages over. ``load_hardware`` is what ``--hw`` resolves: a cluster preset or
file (a YAML mapping with ``nodes``), else a node (``hetplan.hardware.load_node``). Knows
nothing about models or plans.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from hetplan.errors import HetplanError
from hetplan.hardware import HardwareSpec, _UniqueKeyLoader, load_node
from hetplan.pipeline.topology import Network, Topology
from hetplan.presets.clusters import CLUSTER_PRESETS
from hetplan.presets.nodes import NODE_PRESETS
from hetplan.schema.cluster import Cluster
from hetplan.schema.errors import schema_error


def load_hardware(source: str) -> HardwareSpec | Topology:
    """``--hw``: a cluster (preset, or a YAML file with ``nodes``) as a Topology, else a node."""
    if source in CLUSTER_PRESETS:
        text = CLUSTER_PRESETS[source]
        return parse_cluster(yaml.safe_load(text), f"preset {source}", text, Path("."))
    p = Path(source)
    if source not in NODE_PRESETS and p.is_file() and p.suffix in (".yaml", ".yml"):
        try:
            text = p.read_bytes().decode("utf-8")
            raw = yaml.load(text, Loader=_UniqueKeyLoader)
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
            raw = None  # load_node says what is wrong with it
        if isinstance(raw, dict) and "nodes" in raw:
            return parse_cluster(raw, str(p), text, p.parent)
    return load_node(source)


def parse_cluster(raw: dict, source: str, text: str | None, folder: Path) -> Topology:
    """Validate a cluster.yaml mapping and load its nodes (paths relative to ``folder``)."""
    try:
        cluster = Cluster.model_validate(raw)
    except ValidationError as e:
        raise schema_error(e, Cluster, source, text) from None
    nodes = []
    for i, name in enumerate(cluster.nodes):
        where = name if name in NODE_PRESETS or Path(name).is_absolute() else str(folder / name)
        if name not in NODE_PRESETS and not Path(where).exists():
            raise HetplanError(f"{source}: nodes[{i}]: {name!r} is neither a node preset nor a file "
                               f"({where} does not exist); known presets: {', '.join(sorted(NODE_PRESETS))}")
        try:
            nodes.append(load_node(where))
        except HetplanError as e:
            raise HetplanError(f"{source}: nodes[{i}]: {e}") from None
    net = cluster.network
    name = cluster.name if cluster.name is not None else Path(source).stem
    return Topology(name, tuple(nodes), Network(net.bandwidth, net.latency) if net else None)
