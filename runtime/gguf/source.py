"""``GgufWeights``: a .gguf file as the runtime's weight source, memory-mapped.

A backend asks for tensors by Hugging Face name (``TensorSpec.checkpoint``);
``hetplan.frontends.gguf.families.gguf_name`` says which file tensor holds each (a routed
expert is a slice of the stacked ``ffn_*_exps`` tensor: its rows, contiguous in the file). A
llama-architecture file's ``attn_q``/``attn_k`` rows are un-permuted (llama.cpp's converter
interleaves rotary pairs; the runtime rotates halves, as Hugging Face does). ``packed(t, fmt)``
is a linear in its runtime format (``repack.to_runtime``), ``view(t)`` any tensor dequantised
to fp32 (MLA's kv_b_proj, which llama.cpp's converter splits into ``attn_k_b``/``attn_v_b``,
joined back, decoded). Every tensor is read from the mapping once, when its block is placed; ``release``
drops its pages from the process afterwards. Knows nothing about plans, tiers or schedules.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

from hetplan.errors import HetplanError
from hetplan.frontends.gguf.families import check_shapes, gguf_name, permuted_rows
from hetplan.frontends.gguf.header import read_f32, read_header
from hetplan.frontends.gguf.held import price, runtime_format
from hetplan.model import ModelSpec
from hetplan.runtime.backend import TensorSpec
from hetplan.runtime.gguf import repack


class GgufWeights:
    """The tensors of a GGUF file, by Hugging Face name, for the model ``spec``."""

    def __init__(self, path: str | Path, spec: ModelSpec):
        self.path = Path(path)
        self.directory = None
        self.header = read_header(self.path)
        self.spec = spec
        check_shapes(self.header, spec)
        if spec.block_bytes:
            mine = price(self.header, spec, None)
            if (mine.block_bytes, mine.extra.get("gguf")) != (spec.block_bytes, spec.extra.get("gguf")):
                raise HetplanError(f"--weights {self.path}: its tensors (names, types, shapes) are not those the "
                                   f"plan priced; this is not the file the plan was compiled from: recompile it "
                                   f"with `hetplan compile {self.path}`")
        self._check_expert_pairs()
        self._check_rope_freqs()
        with open(self.path, "rb") as fh:
            # A private mapping: pages stay shared with the page cache until written.
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)

    def _check_rope_freqs(self) -> None:
        """The plan rotates by the frequency factors it was compiled with; they must be this file's."""
        t = self.header.tensors.get("rope_freqs.weight")
        if t is None:   # nothing in the file to compare the plan's factors with
            return
        planned = (self.spec.rope_scaling or {}).get("freq_factors") or ()
        if read_f32(self.header, t.name, t.numel) != list(planned):
            raise HetplanError(f"--weights {self.path}: its rope_freqs.weight differs from the frequency factors "
                               f"the plan was compiled with; recompile it with `hetplan compile {self.path}`")

    def _check_expert_pairs(self) -> None:
        """A routed expert's gate and up projections are multiplied as one (fused) linear: they
        must be held in one format."""
        for l in range(self.spec.n_layers):
            gate, up = (self.header.tensors.get(f"blk.{l}.ffn_{p}_exps.weight") for p in ("gate", "up"))
            if gate and up and runtime_format(gate) != runtime_format(up):
                raise HetplanError(f"--weights {self.path}: blk.{l}.ffn_gate_exps is {gate.type} and ffn_up_exps "
                                   f"{up.type}; the runtime multiplies an expert's gate and up together and "
                                   f"needs them in one format (compile with --weight-dtype q8_0 to requantise)")

    # -- the weight-source interface -----------------------------------------------------------
    def _split_kv_b(self, expected: TensorSpec):
        """(attn_k_b, attn_v_b) when ``expected`` is MLA's kv_b_proj and the file holds it split, as
        llama.cpp's converter writes it (``families.check_shapes``), else None."""
        found = gguf_name(expected.checkpoint)
        if found is None or not found[0].endswith(".attn_kv_b.weight") or found[0] in self.header.tensors:
            return None
        k, v = (self.header.tensors.get(found[0].replace("attn_kv_b", part)) for part in ("attn_k_b", "attn_v_b"))
        return (k, v) if k is not None and v is not None else None

    def _joined_kv_b(self, pair) -> torch.Tensor:
        """kv_b_proj, fp32 [H (nope + v), r], from W_UK^T [H, r, nope] and W_UV [H, v, r]."""
        k_t, v_t = pair
        r, h = k_t.shape[1], k_t.shape[2]
        k = self._decode(k_t).view(h, r, -1).transpose(1, 2)          # [H, nope, r]
        v = self._decode(v_t).view(h, -1, r)                          # [H, v, r]
        return torch.cat((k, v), dim=1).reshape(-1, r)

    def _decode(self, t) -> torch.Tensor:
        """A whole tensor's values, fp32 [rows, cols] in file order."""
        cols, data = self._file_rows(t)
        return repack.dequantise(t.type, data, cols)

    def _tensor(self, expected: TensorSpec):
        found = gguf_name(expected.checkpoint)
        t = self.header.tensors.get(found[0]) if found else None
        if t is None:
            raise HetplanError(f"--weights {self.path}: no tensor for {expected.checkpoint!r} "
                               f"({found[0] if found else 'no GGUF name'}); this file is not the plan's model")
        return t, found[1]

    def check(self, expected: TensorSpec, dtype, where: str) -> None:
        if self._split_kv_b(expected) is not None:
            return   # the pair's shapes were checked against the metadata (check_shapes)
        t, expert = self._tensor(expected)
        shape = tuple(reversed(t.shape))
        shape = shape[1:] if expert is not None else shape
        if shape != tuple(expected.shape):
            raise HetplanError(f"--weights {self.path}: tensor {t.name!r} holds {list(shape)} for "
                               f"{expected.checkpoint!r}, the plan's model expects {list(expected.shape)} ({where}); "
                               f"recompile the plan from this file")

    def _rows(self, expected: TensorSpec):
        """(ggml type, cols, uint8 rows [R, bytes per row]) of the tensor, over the mapping."""
        t, expert = self._tensor(expected)
        return (t, *self._file_rows(t, expert))

    def _file_rows(self, t, expert: int | None = None):
        """(cols, uint8 rows [R, bytes per row]) of file tensor ``t`` (of routed expert ``expert``
        in a stacked one), over the mapping."""
        cols = t.shape[0]
        rows = t.numel // cols
        per_row = repack.row_bytes(t.type, cols)
        offset = t.offset
        if expert is not None:
            rows //= t.shape[-1]
            offset += expert * rows * per_row
        buf = memoryview(self._map)[offset:offset + rows * per_row]
        return cols, torch.frombuffer(buf, dtype=torch.uint8).view(rows, per_row)

    def _order(self, t, rows: int) -> torch.Tensor | None:
        """Row order undoing llama.cpp's q/k permutation: HF row i is file row order[i]."""
        heads = permuted_rows(self.spec, t.name)
        if heads is None:
            return None
        return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)

    def format_of(self, expected: TensorSpec) -> str | None:
        """The runtime format linear ``expected`` is held in (None: unquantised)."""
        if self._split_kv_b(expected) is not None:
            return None
        return runtime_format(self._tensor(expected)[0])

    def packed(self, expected: TensorSpec, fmt: str) -> torch.Tensor:
        """The linear packed in runtime format ``fmt`` (``quant.split`` reads it back): its
        row-part arrays, each [rows, count], one after the other."""
        t, cols, data = self._rows(expected)
        parts = repack.to_runtime(t.type, data, cols)
        order = self._order(t, data.shape[0])
        if order is not None:
            parts = tuple(p[order] for p in parts)
        return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])

    def view(self, expected: TensorSpec, dtype: torch.dtype | None) -> torch.Tensor:
        """The tensor's values, fp32 (or ``dtype``), in the Hugging Face shape and row order."""
        pair = self._split_kv_b(expected)
        if pair is not None:
            x = self._joined_kv_b(pair).reshape(expected.shape)
            return x if dtype is None else x.to(dtype)
        t, cols, data = self._rows(expected)
        x = repack.dequantise(t.type, data, cols)
        order = self._order(t, data.shape[0])
        if order is not None:
            x = x[order]
        x = x.reshape(expected.shape)
        return x if dtype is None else x.to(dtype)

    def fill(self, expected: TensorSpec, out: torch.Tensor) -> None:
        out.copy_(self.view(expected, None))
        self.release(expected)

    def release(self, expected: TensorSpec) -> None:
        """Drop the tensor's pages from this process's resident set (they stay in the page cache)."""
        for t in self._split_kv_b(expected) or (self._tensor(expected)[0],):
            if not hasattr(mmap, "MADV_DONTNEED") or t.nbytes == 0:
                continue
            begin = t.offset - t.offset % mmap.PAGESIZE
            end = min(len(self._map), -(-(t.offset + t.nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)
            self._map.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def close(self) -> None:
        self._map.close()

    def tokenizer_dir(self) -> None:
        return None

    def tokenizer(self):
        """The file's own tokenizer (``tokenizer.ggml.*``) through transformers' GGUF loading, or
        None when the file has none."""
        if not self.header.tokenizer:
            return None
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        try:
            return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        except Exception as e:   # transformers' converters raise anything on a tokenizer they cannot build
            raise HetplanError(f"--weights {self.path}: transformers cannot build the file's tokenizer "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass "
                               f"--prompt-ids instead of --prompt") from None
