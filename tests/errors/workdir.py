"""A working directory of good input files, a snapshot of it, and running the CLI in-process."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from hetplan.cli import main

NODE = """\
name: tiny
gpus:
  - name: test gpu
    memory: 2GiB
    mem_bandwidth: 100GB/s
    flops: {fp32: 10TFLOPS, bf16: 20TFLOPS}
cpu:
  name: cpu
  cores: 2
  memory: 8GiB
  mem_bandwidth: 20GB/s
  flops: {fp32: 1TFLOPS}
links: {h2d: 10GB/s}
reserve: {gpu: 1KiB, cpu: 1KiB}
"""

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "torch_dtype": "float32"}

MOE_CONFIG = dict(CONFIG, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)


def populate(folder: Path, plan_text: str | None = None) -> None:
    """Write node.yaml, config.json, moe.json (and plan.json when given) into ``folder``."""
    (folder / "node.yaml").write_text(NODE)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "moe.json").write_text(json.dumps(MOE_CONFIG))
    if plan_text is not None:
        (folder / "plan.json").write_text(plan_text)


def snapshot(folder: Path) -> dict:
    """Every entry below ``folder``: its kind, mode and (for files) bytes."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root, name)
            st = p.lstat()
            out[str(p.relative_to(folder))] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode),
                                               p.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


def run(argv, capsys) -> tuple[int, str, str]:
    """``hetplan ARGV`` in this process -> (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def error_lines(stderr: str) -> list:
    """stderr without its progress lines (``hetplan: progress: ...``, which a slow run prints before
    an error as it does before a result)."""
    return [ln for ln in stderr.strip().splitlines() if not ln.startswith("hetplan: progress: ")]
