"""Lookup tables (token and position embeddings): rows looked up by index, never multiplied
whole, so a table need not be in memory to be read.

A ``FileTable`` is a ``[rows, ...]`` tensor of a checkpoint file read on demand: a lookup reads
the rows it asks for (one ``pread`` per distinct row, a slice in one), and the process holds
nothing else of the table. The file's pages it read stay in the page cache, which the kernel
may reclaim; a memory mapping would do the same but for how much it maps per fault (up to a
whole page-cache folio, megabytes, for each row looked up), which a table looked up by random
token ids turns into most of the table. ``lookup`` and slicing accept a plain tensor too, so a
stage reads a table the same way wherever the plan put it. Knows nothing about plans or tiers.
"""

from __future__ import annotations

import math
import os
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F


class FileTable:
    """A table stored at byte ``offset`` of ``path`` (row-major, ``dtype``), read on demand."""

    def __init__(self, path: str | Path, offset: int, shape: tuple, dtype: torch.dtype):
        self.path, self.offset, self.shape, self.dtype = Path(path), offset, tuple(shape), dtype
        self.row_bytes = math.prod(self.shape[1:]) * torch.empty((), dtype=dtype).element_size()
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def _read(self, spans: list) -> torch.Tensor:
        """Rows [first, first + count) for each (first, count) of ``spans``, one after the other
        -> a tensor [sum of counts, ...] of its own."""
        buf = bytearray(sum(count for _, count in spans) * self.row_bytes)
        view, at = memoryview(buf), 0
        for first, count in spans:
            n = count * self.row_bytes
            got = os.preadv(self._fd, [view[at:at + n]], self.offset + first * self.row_bytes)
            if got != n:
                raise OSError(f"{self.path}: read {got} of {n} bytes of a table; the file changed on disk")
            at += n
        return torch.frombuffer(buf, dtype=self.dtype).view(-1, *self.shape[1:]) if buf else \
            torch.empty((0, *self.shape[1:]), dtype=self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``F.embedding(ids, table)``: [*ids.shape, ...]; IndexError for an id outside the table."""
        flat = ids.reshape(-1)
        if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < self.shape[0]:
            raise IndexError(f"lookup of ids in [{int(flat.min())}, {int(flat.max())}] in a table of {self.shape[0]} rows")
        distinct, where = torch.unique(flat, return_inverse=True)
        return self._read([(r, 1) for r in distinct.tolist()])[where].view(*ids.shape, *self.shape[1:])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        """Contiguous rows (a learned position table's ``[lo:hi]``), read in one."""
        first, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise IndexError("a FileTable is sliced with step 1 only")
        return self._read([(first, max(0, stop - first))])


def lookup(table, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``table`` (a tensor, or a ``FileTable``)."""
    return table.rows(ids) if isinstance(table, FileTable) else F.embedding(ids, table)
