"""GGUF files (llama.cpp's format) as a model source: header and metadata, never tensor data.

``header`` opens a file with the ``gguf`` package (memory-mapped: only the header pages are
read) and lists its metadata and tensors (name, ggml type, shape, bytes); ``families`` maps each
architecture's metadata keys to a ``ModelSpec`` and the file's tensor names to the Hugging Face
names the runtime's backends use; ``held`` is the conversion rule (which runtime format each
file type is held in) and the bytes each block takes, in the file and as held. Knows nothing
about machines, costs, solvers or torch.
"""

from __future__ import annotations

__all__ = ["spec_from_gguf"]


def __getattr__(name: str):
    if name == "spec_from_gguf":
        from hetplan.frontends.gguf.families import spec_from_gguf
        return spec_from_gguf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
