"""A GGUF file's header: metadata values and the tensor directory, read memory-mapped.

``read_header(path)`` parses the header with ``gguf.GGUFReader`` (a ``numpy.memmap``: tensor
bytes are never touched) and checks that every tensor's data lies inside the file, so a
truncated download is refused here, naming the first tensor cut off. Any malformed header is
one ``HetplanError`` line. Shapes are kept in ggml order (``ne0`` first: the input dim of a
linear weight), as the file stores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetplan.errors import HetplanError

MAGIC = b"GGUF"


@dataclass(frozen=True)
class GgufTensor:
    name: str
    type: str
    """ggml type name (``Q4_K``, ``F32``...)."""
    shape: tuple
    """ggml order: ``(ne0, ne1, ...)``, ne0 the contiguous (input) dim."""
    nbytes: int
    offset: int
    """Byte offset of the data in the file."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class GgufHeader:
    path: str
    arch: str
    metadata: dict
    """key -> value (strings, numbers, lists of numbers); arrays of strings (the tokenizer's
    vocabulary) are left out."""
    tensors: dict
    """name -> GgufTensor, in file order."""
    tokenizer: bool = False
    """Whether the file carries a tokenizer (``tokenizer.ggml.tokens``)."""

    def get(self, key: str, default=...):
        """Metadata ``key``, or ``default``; a missing key without a default is an error naming it."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ...:
            raise HetplanError(f"{self.path}: missing metadata key {key!r} (needed for architecture {self.arch!r})")
        return default


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic (or is named ``*.gguf``)."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as fh:
            return fh.read(4) == MAGIC
    except OSError:
        return False


def read_header(path: str | Path) -> GgufHeader:
    """Parse the header of GGUF file ``path``; one-line errors for a missing, non-GGUF, truncated
    or corrupt file."""
    p = Path(path)
    if not p.is_file():
        if p.exists():  # never opened: a FIFO would block
            from hetplan.files import kind_of
            raise HetplanError(f"{p}: is {kind_of(p.stat().st_mode)}, not a file; expected a .gguf model file")
        raise HetplanError(f"{p}: no such file (expected a .gguf model file)")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != MAGIC:
        raise HetplanError(f"{p}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a "
                           f"llama.cpp .gguf model, a config.json or a preset name")
    try:
        from gguf import GGUFReader, GGUFValueType
    except ImportError:
        raise HetplanError("reading .gguf files needs the gguf package: pip install 'hetplan[gguf]'") from None
    try:
        reader = GGUFReader(str(p))
    except ValueError as e:
        msg = str(e)
        if "is not a valid GGMLQuantizationType" in msg:
            raise HetplanError(f"{p}: a tensor has an unknown ggml type id ({msg}); the file is corrupt "
                               f"or newer than the gguf package reads") from None
        raise HetplanError(f"{p}: malformed GGUF header ({msg}); the file is truncated or corrupt") from None
    except (IndexError, OverflowError, MemoryError, UnicodeDecodeError, TypeError, KeyError) as e:
        raise HetplanError(f"{p}: malformed GGUF header ({type(e).__name__}); the file is truncated "
                           f"or corrupt") from None
    size = p.stat().st_size
    tensors = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise HetplanError(f"{p}: tensor {t.name!r} ends at byte {end}, past the end of the file "
                               f"({size} bytes); the file is truncated")
        tensors[t.name] = GgufTensor(t.name, t.tensor_type.name, tuple(int(s) for s in t.shape),
                                     int(t.n_bytes), int(t.data_offset))
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key.startswith("tokenizer.ggml."):
            continue
        try:
            metadata[key] = _shortest(field.contents()) if field.types[:1] == [GGUFValueType.FLOAT32] \
                else field.contents()
        except (ValueError, IndexError, UnicodeDecodeError):
            raise HetplanError(f"{p}: metadata key {key!r} is malformed; the file is corrupt") from None
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise HetplanError(f"{p}: missing metadata key 'general.architecture'; not a model file")
    return GgufHeader(str(p), arch, metadata, tensors, "tokenizer.ggml.tokens" in reader.fields)


def read_f32(h: GgufHeader, name: str, count: int) -> list[float]:
    """The ``count`` values of F32 tensor ``name``, read from the file (a few hundred bytes: for
    the small tensors a plan keeps, such as ``rope_freqs.weight``); one-line errors when the
    tensor has another type or size."""
    import numpy as np
    t = h.tensors[name]
    if t.type != "F32" or t.shape != (count,):
        raise HetplanError(f"{h.path}: tensor {name!r} is {t.type} {list(t.shape)}; expected F32 [{count}] "
                           f"(one value per rotary frequency); the file is corrupt or from an unknown converter")
    values = np.fromfile(h.path, dtype="<f4", count=count, offset=t.offset)
    return [_shortest(v) for v in values]


def _shortest(v: float) -> float:
    """A float32 value as the shortest decimal that reads back to it (1e-05, not
    9.999999747378752e-06): what the converter was given, and what a plan keeps exactly."""
    import numpy as np
    return float(np.format_float_scientific(np.float32(v), unique=True))
