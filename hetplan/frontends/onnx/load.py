"""Read an ``.onnx`` file's graph without its weights, and refuse files that cannot be used.

Initializers stored as external data stay on disk: only their names, dtypes and shapes are read,
so a multi-gigabyte export is opened in the memory of its graph. Checked here, each with a
message that says what to do: the file exists and parses, the graph is complete (every value a
node reads is produced earlier), every external-data file is present and long enough (checked
again each time a cached graph is reused).
Knows nothing about blocks, shapes or costs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hetplan.errors import HetplanError

FLOAT_TYPES = {1: "fp32", 10: "fp16", 16: "bf16", 11: "fp64"}
"""ONNX TensorProto element types of floating point weights -> hetplan dtype names."""
ITEMSIZE = {1: 4, 2: 1, 3: 1, 4: 2, 5: 2, 6: 4, 7: 8, 9: 1, 10: 2, 11: 8, 12: 4, 13: 8, 16: 2}
"""Bytes per element of ONNX TensorProto element types (float, uint8, int8, uint16, int16,
int32, int64, bool, float16, double, uint32, uint64, bfloat16)."""


def _onnx():
    try:
        import onnx
    except ImportError:
        raise HetplanError("reading .onnx models needs the onnx package: pip install 'hetplan[onnx]'") from None
    return onnx


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_model(path: str | Path):
    """Parse ``path`` into a ModelProto whose external initializers are not loaded."""
    onnx = _onnx()
    p = Path(path)
    if not p.is_file():
        raise HetplanError(f"{p}: no such ONNX file")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning-derived errors, ...
        raise HetplanError(f"{p}: not a readable ONNX model ({type(e).__name__}: {e}); the file "
                           f"may be truncated or not ONNX at all: export it again") from None
    if not model.graph.node:
        raise HetplanError(f"{p}: the ONNX file holds no graph nodes (empty, truncated or not "
                           f"an ONNX model): export it again")
    check_complete(model, p)
    check_external_data(p, external_files(model, p))
    return model


def check_complete(model, source: Path) -> None:
    """Every node input is a graph input, an initializer or the output of an earlier node."""
    g = model.graph
    known = {v.name for v in g.input} | {t.name for t in g.initializer} | {""}
    for node in g.node:
        for name in node.input:
            if name not in known:
                raise HetplanError(f"{source}: node {node.name or node.op_type!r} reads {name!r}, "
                                   f"which no earlier node, input or initializer provides: the "
                                   f"graph is truncated or not topologically sorted; export it again")
        known.update(node.output)
    for out in g.output:
        if out.name not in known:
            raise HetplanError(f"{source}: graph output {out.name!r} is never produced: the graph "
                               f"is truncated; export it again")


def external_entries(tensor) -> dict:
    return {e.key: e.value for e in tensor.external_data}


def external_files(model, source: Path) -> dict:
    """External-data file name -> the bytes its initializers need (the largest offset + length)."""
    need = {}
    for t in model.graph.initializer:
        if t.data_location != 1:  # TensorProto.EXTERNAL
            continue
        ext = external_entries(t)
        loc = ext.get("location")
        if not loc:
            raise HetplanError(f"{source}: initializer {t.name!r} is marked external but names no file")
        length = int(ext.get("length", numel(t) * ITEMSIZE.get(t.data_type, 1)))
        end = int(ext.get("offset", 0)) + length
        if end > need.get(loc, (0, ""))[0]:
            need[loc] = (end, t.name)
    return need


def check_external_data(source: Path, need: dict) -> None:
    """Each external-data file exists beside the model and covers what its initializers need."""
    for loc, (end, name) in sorted(need.items()):
        f = source.parent / loc
        if not f.is_file():
            raise HetplanError(f"{source}: initializer {name!r} keeps its data in {loc!r}, which "
                               f"is missing ({f}); copy the external-data file next to the .onnx")
        size = f.stat().st_size
        if end > size:
            raise HetplanError(f"{source}: external-data file {loc!r} is truncated: initializer "
                               f"{name!r} needs bytes up to {end}, the file has {size}")


def numel(tensor) -> int:
    n = 1
    for d in tensor.dims:
        n *= int(d)
    return n
