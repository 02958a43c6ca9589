"""``hetplan serve`` runs a plan on one GPU; a plan over several devices (a pipeline, or replicas
of one) is refused in one line saying what to do, exit 2, before anything is loaded. (Before,
it took the plan's main part, the first stage's layers alone, for the whole model.)"""

from __future__ import annotations

import subprocess
import sys

from hetplan.workload import Workload
from tests.distributed.pipelines import pipeline_plan


def test_serve_refuses_a_pipeline_plan_in_one_line(llama_files, tmp_path):
    model_dir, node, _ = llama_files
    path = tmp_path / "plan.json"
    pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "all-gpu"], Workload(1, 8, 4, prefill_chunk=8), path)
    out = subprocess.run([sys.executable, "-m", "hetplan", "serve", str(path), "--weights", str(model_dir),
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    (line,) = [l for l in out.stderr.splitlines() if l.startswith("hetplan: error:")]
    assert line.startswith(f"hetplan: error: {path}: the plan runs over several devices (2 pipeline stage(s)), and "
                           f"hetplan serve runs a plan on one GPU only; compile it for serving with a node of one GPU")
    assert f"`hetplan exec {path}`" in line
    assert "Traceback" not in out.stderr and "hetplan serve:" not in out.stderr
