"""Where weights come from: a safetensors checkpoint read lazily by name, or seeded random values.

A ``Checkpoint`` parses the headers of a directory's ``*.safetensors`` files (through
``model.safetensors.index.json`` when there is one) and memory-maps each file once: ``view(name)``
is a zero-copy CPU tensor over the file's pages, so a tensor is read from disk only when its tier
copies it; ``release(name)`` then drops that tensor's pages from the process (they stay in the
page cache), so while placing, the process holds the placed weights plus at most one tensor's
mapped pages, never a second full copy; ``close`` unmaps the files afterwards. ``table(name)``
is a lookup table read from the file a row at a time (``hetplan.runtime.lookup.FileTable``).
``RandomWeights`` makes the same tensors from a seed: every value depends on the seed and the
tensor's checkpoint name only, never on where the plan puts it.

A .gguf file is read by ``hetplan.runtime.gguf.source.GgufWeights`` (``weight_source`` picks it).
Both are checked against the tensors a backend expects before anything is loaded; the first
tensor that is missing or has the wrong shape or dtype is named. Knows nothing about plans or tiers.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from hetplan.errors import HetplanError
from hetplan.frontends.gguf.header import is_gguf
from hetplan.runtime.backend import TensorSpec
from hetplan.runtime.lookup import FileTable

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Plan weight dtypes the runtime executes."""
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}
_PLAN_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(name: str, option: str) -> torch.dtype:
    """The torch dtype of a plan's unquantised weight or KV dtype; ``option`` names the compile
    option that chose it (``--weight-dtype``, ``--kv-dtype``)."""
    if name not in TORCH_DTYPES:
        raise HetplanError(f"plan {option} {name}: the torch runtime keeps these in {', '.join(TORCH_DTYPES)}"
                           f"{' (weights also in int8 int4 q8_0 q4_0 q4_k_m)' if option == '--weight-dtype' else ''}; "
                           f"recompile the plan with {option} set to one of them")
    return TORCH_DTYPES[name]


class Checkpoint:
    """The tensors of a Hugging Face safetensors checkpoint directory, by name, memory-mapped."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise HetplanError(f"--weights {directory}: no such directory (pass a checkpoint directory "
                               f"holding *.safetensors, or 'random')")
        files = self._files()
        self._entries = {}   # name -> (file, dtype, shape, byte offset in file, nbytes)
        for f in files:
            for name, (dtype, shape, offset, nbytes) in _read_header(f).items():
                self._entries[name] = (f, dtype, shape, offset, nbytes)
        self._maps = {}

    def _files(self) -> list[Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:  # ValueError: also not UTF-8, or a 5000-digit number
                raise HetplanError(f"{index}: malformed index ({e}); expected a 'weight_map' object") from None
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise HetplanError(f"{index}: names shard files that do not exist: {', '.join(missing)}")
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise HetplanError(f"--weights {self.directory}: no *.safetensors files (a PyTorch .bin "
                               f"checkpoint can be converted with transformers' save_pretrained)")
        return files

    def resolve(self, name: str) -> str | None:
        """``name`` as stored: exactly, or without its leading module (a base model saved alone)."""
        if name in self._entries:
            return name
        short = name.split(".", 1)[1] if "." in name else name
        if name.startswith("model.decoder."):
            short = name[len("model."):]
        return short if short in self._entries else None

    def check(self, expected: TensorSpec, dtype: torch.dtype, where: str) -> None:
        stored = self.resolve(expected.checkpoint)
        if stored is None:
            raise HetplanError(f"--weights {self.directory}: no tensor {expected.checkpoint!r} (needed by "
                               f"{where}); these weights are not the plan's model")
        f, st_dtype, shape, _, _ = self._entries[stored]
        if tuple(shape) != tuple(expected.shape):
            raise HetplanError(f"--weights {self.directory}: tensor {stored!r} in {f.name} has shape "
                               f"{list(shape)}, the plan's model expects {list(expected.shape)} ({where}); "
                               f"these weights are not the model the plan was compiled for")
        if dtype is None:  # quantised at load time: any float checkpoint will do
            if st_dtype not in _PLAN_NAMES:
                raise HetplanError(f"--weights {self.directory}: tensor {stored!r} in {f.name} is {st_dtype}; "
                                   f"a plan with quantised weights is loaded from fp32, fp16 or bf16 tensors")
            return
        if st_dtype != dtype:
            raise HetplanError(f"--weights {self.directory}: tensor {stored!r} in {f.name} is "
                               f"{_PLAN_NAMES.get(st_dtype, st_dtype)}, the plan's model is "
                               f"{_PLAN_NAMES[dtype]} ({where}); compile the plan with --weight-dtype "
                               f"{_PLAN_NAMES.get(st_dtype, st_dtype)}")

    def view(self, expected: TensorSpec, dtype: torch.dtype | None) -> torch.Tensor:
        """A CPU tensor over the file's pages (no copy), in its stored dtype (``check`` checked it
        is ``dtype``; None: any float)."""
        f, dtype, shape, offset, nbytes = self._entries[self.resolve(expected.checkpoint)]
        if f not in self._maps:
            with open(f, "rb") as fh:
                # A private mapping: pages stay shared with the page cache until written.
                self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        # Through a memoryview: while the tensor lives the mapping cannot be closed under it.
        return torch.frombuffer(memoryview(self._maps[f])[offset:offset + nbytes], dtype=dtype).view(shape)

    def table(self, expected: TensorSpec) -> FileTable:
        """The tensor as a lookup table read row by row from its file (``FileTable``), in its
        dtype as stored; it outlives ``close``."""
        f, dtype, shape, offset, _ = self._entries[self.resolve(expected.checkpoint)]
        return FileTable(f, offset, shape, dtype)

    FILL_CHUNK_BYTES = 2 << 20
    """Bytes copied out of the mapping before its pages are let go: the most a ``fill`` holds
    resident beside the placed copy."""

    def fill(self, expected: TensorSpec, out: torch.Tensor) -> None:
        """Copy the tensor into ``out`` (a contiguous CPU destination: ``FILL_CHUNK_BYTES`` at a
        time, each chunk's mapped pages let go once copied), then ``release`` the whole tensor."""
        src = self.view(expected, out.dtype)
        if out.device.type != "cpu" or not out.is_contiguous():
            out.copy_(src)
        else:
            dst, flat = out.view(-1), src.reshape(-1)
            step = max(1, self.FILL_CHUNK_BYTES // max(1, src.element_size()))
            _, _, _, offset, _ = self._entries[self.resolve(expected.checkpoint)]
            for lo in range(0, flat.numel(), step):
                hi = min(flat.numel(), lo + step)
                dst[lo:hi].copy_(flat[lo:hi])
                self._drop(expected, offset + lo * src.element_size(), (hi - lo) * src.element_size())
        del src
        self.release(expected)

    def release(self, expected: TensorSpec) -> None:
        """Drop the tensor's pages from this process's resident set (``_drop`` over its bytes)."""
        _, _, _, offset, nbytes = self._entries[self.resolve(expected.checkpoint)]
        self._drop(expected, offset, nbytes)

    def release_rows(self, expected: TensorSpec, r0: int, r1: int) -> None:
        """Drop the pages of rows [r0, r1) (along the first dim) of the tensor."""
        _, _, shape, offset, nbytes = self._entries[self.resolve(expected.checkpoint)]
        row = nbytes // max(1, shape[0]) if shape else nbytes
        self._drop(expected, offset + r0 * row, (r1 - r0) * row)

    def _drop(self, expected: TensorSpec, offset: int, nbytes: int) -> None:
        """``MADV_DONTNEED`` over file bytes [offset, offset + nbytes), widened to whole pages. The
        mapping is private and never written, so a page dropped is read again from the page cache
        if touched later (a neighbour's bytes on a shared page, a tied embedding): nothing is
        lost, only residency."""
        f = self._entries[self.resolve(expected.checkpoint)][0]
        m = self._maps.get(f)
        if m is None or nbytes == 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin = offset - offset % mmap.PAGESIZE
        end = min(len(m), -(-(offset + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
        m.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def close(self) -> None:
        """Unmap the files, once every tensor needed was copied out of them (BufferError while
        a view is still alive)."""
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def tokenizer_dir(self) -> Path | None:
        return self.directory if (self.directory / "tokenizer.json").is_file() or \
            (self.directory / "tokenizer_config.json").is_file() else None


def _read_header(path: Path) -> dict:
    """safetensors: 8-byte little-endian header length N, N bytes of JSON
    ``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the data (offsets relative to it)."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
    except (struct.error, ValueError, MemoryError, OverflowError) as e:  # ValueError: bad JSON, not UTF-8
        raise HetplanError(f"{path}: not a safetensors file ({type(e).__name__}); the file may be "
                           f"truncated") from None
    size = path.stat().st_size
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _ST_DTYPES:
            raise HetplanError(f"{path}: tensor {name!r} has dtype {meta['dtype']}, which the runtime cannot read")
        begin, end = meta["data_offsets"]
        if 8 + n + end > size:
            raise HetplanError(f"{path}: tensor {name!r} ends past the end of the file; the file is truncated")
        out[name] = (_ST_DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + n + begin, end - begin)
    return out


class RandomWeights:
    """Seeded random weights for any spec: uniform values with the spread of a fresh model
    (std 0.02; norm scales 1 +- 0.1), a pure function of (seed, checkpoint name)."""

    CHUNK = 1 << 22
    """Elements drawn per generator: chunks are independent, so they are drawn in parallel."""

    def __init__(self, seed: int):
        self.seed = seed
        self.directory = None

    def check(self, expected: TensorSpec, dtype: torch.dtype, where: str) -> None:
        return None

    def view(self, expected: TensorSpec, dtype: torch.dtype | None) -> torch.Tensor:
        """The tensor in ``dtype`` (None: fp32)."""
        out = torch.empty(expected.shape, dtype=dtype or torch.float32)
        self.fill(expected, out)
        return out

    def release(self, expected: TensorSpec) -> None:
        return None

    def release_rows(self, expected: TensorSpec, r0: int, r1: int) -> None:
        return None

    def fill(self, expected: TensorSpec, out: torch.Tensor) -> None:
        if out.device.type != "cpu":
            out.copy_(self.view(expected, out.dtype))
            return
        name = expected.checkpoint
        norm_scale = expected.local.endswith("norm")
        half_width = (0.1 if norm_scale else 0.02) * math.sqrt(3.0)
        flat = out.view(-1)
        n = flat.numel()

        def chunk(i: int) -> None:
            lo, hi = i * self.CHUNK, min(n, (i + 1) * self.CHUNK)
            g = torch.Generator().manual_seed(_chunk_seed(self.seed, name, i))
            vals = torch.empty(hi - lo, dtype=torch.float32).uniform_(-half_width, half_width, generator=g)
            if norm_scale:
                vals += 1.0
            flat[lo:hi].copy_(vals)

        count = -(-n // self.CHUNK)
        if count == 1:
            chunk(0)
        else:
            with ThreadPoolExecutor(max_workers=torch.get_num_threads()) as pool:
                list(pool.map(chunk, range(count)))

    def close(self) -> None:
        return None

    def tokenizer_dir(self) -> None:
        return None


def _chunk_seed(seed: int, name: str, index: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def weight_source(weights: str, seed: int, spec=None):
    """``--weights random``, a .gguf file of the model ``spec`` (``hetplan.runtime.gguf``) or a
    checkpoint directory."""
    if weights == "random":
        return RandomWeights(seed)
    if Path(weights).suffix.lower() == ".gguf" or (Path(weights).is_file() and is_gguf(weights)):
        from hetplan.runtime.gguf.source import GgufWeights
        return GgufWeights(weights, spec)
    return Checkpoint(weights)


def random_state_dict(backend, blocks, dtype: torch.dtype, seed: int) -> dict:
    """{checkpoint name: tensor} of ``RandomWeights(seed)`` for ``blocks`` ((name, kind, layer)):
    the same values ``--weights random --seed`` runs with, e.g. to load into a reference model."""
    src, out = RandomWeights(seed), {}
    for name, kind, layer in blocks:
        for t in backend.block_tensors(name, kind, layer):
            if t.checkpoint not in out:
                out[t.checkpoint] = src.view(t, dtype)
    return out
