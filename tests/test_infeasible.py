"""When nothing fits, the compiler says how many bytes are missing and how to fix it; memory
overrides (--gpu-mem, --cpu-mem) change the plan."""

import re

import pytest

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import InfeasibleError
from hetplan.graph import workspace_bytes
from hetplan.presets.models import model_preset
from hetplan.units import format_bytes
from hetplan.workload import Workload

GIB = 1 << 30


def test_model_too_big_for_gpu_and_cpu_together_states_missing_bytes_and_fixes():
    # llama-3.1-70b in bf16 on a laptop: 7.25 GiB of GPU + 28 GiB of DRAM usable
    spec = model_preset("llama-3.1-70b")
    wl = Workload(batch=1, prompt_len=512, gen_len=128)
    weights = spec.total_params() * 2
    kv = spec.n_layers * 640 * (2 * 8 * 128 * 2)      # layers * tokens * (K and V of 8 heads of 128, bf16)
    need = weights + kv + workspace_bytes(spec, wl, "gpu") + workspace_bytes(spec, wl, "cpu")  # one per device
    have = (8 - 0.75) * GIB + (32 - 4) * GIB
    with pytest.raises(InfeasibleError) as err:
        compile_plan(CompileRequest(model="llama-3.1-70b", hw="laptop-8g", weight_dtype="bf16"))
    msg = str(err.value)
    assert f"missing {format_bytes(need - have)} in total" in msg
    assert f"weights {format_bytes(weights)} (bf16)" in msg
    # q4_k_m (4.875 bits: 40 GiB of weights) does not fit 35.25 GiB, so it is not offered; a dtype
    # that is offered must really compile; the DRAM that would be enough is, rounded up to a GiB (a
    # machine with it: --cpu-mem may not exceed the laptop's 32 GiB)
    assert "--weight-dtype q4_k_m" not in msg and "--weight-dtype q8_0" not in msg
    offered = re.search(r"--weight-dtype (\S+) \(weights", msg)
    if offered:
        compile_plan(CompileRequest(model="llama-3.1-70b", hw="laptop-8g", weight_dtype=offered.group(1)))
    assert f"cpu.memory: {-(-int(need - have + 32 * GIB) // GIB)}GiB" in msg and "--cpu-mem" not in msg


def test_a_model_larger_than_gpu_and_cpu_together_is_refused_before_any_solver_runs(monkeypatch):
    # 70B in bf16 (131 GiB) on the laptop's 35.25 GiB: the memory bound alone decides it, so
    # a search limit that stops every MILP before its first plan cannot turn it into "raise
    # --max-nodes"
    from hetplan.solvers import ilp

    def no_solve(*args, **kwargs):
        raise AssertionError("the MILP ran for a model that cannot fit")

    monkeypatch.setattr(ilp, "solve", no_solve)
    with pytest.raises(InfeasibleError, match=r"no placement fits: .* missing [\d.]+ GiB in total"):
        compile_plan(CompileRequest(model="llama-3.1-70b", hw="laptop-8g", weight_dtype="bf16", max_nodes=1))


def test_automatic_dtype_gives_up_with_the_same_diagnosis():
    with pytest.raises(InfeasibleError, match=r"no placement fits: .* missing [\d.]+ GiB in total"):
        compile_plan(CompileRequest(model="llama-3.1-70b", hw="laptop-8g"))


def test_cpu_too_small_for_what_the_gpu_cannot_hold():
    # llama-3.2-1b (2.79 GiB in bf16) with 1 GiB of GPU and 1 GiB of DRAM usable
    with pytest.raises(InfeasibleError, match=r"GPU 1\.00 GiB \+ CPU 1\.00 GiB = 2\.00 GiB are available; "
                                              r"missing [\d.]+ MiB in total"):
        compile_plan(CompileRequest(model="llama-3.2-1b", hw="laptop-8g", weight_dtype="bf16",
                                    gpu_mem="1GiB", cpu_mem="1GiB"))


def test_baseline_that_does_not_fit_says_by_how_much():
    # llama-2-7b fp16: 6.74e9 params * 2 bytes = 12.55 GiB of weights alone, over 7.25 GiB
    with pytest.raises(InfeasibleError, match=r"strategy all-gpu: GPU needs [\d.]+ GiB more \([\d.]+ GiB > "
                                              r"budget 7\.25 GiB\): use --strategy ilp"):
        compile_plan(CompileRequest(model="llama-2-7b", hw="laptop-8g", weight_dtype="fp16", strategy="all-gpu"))


def test_cli_reports_infeasibility_in_one_line_with_exit_code_2(capsys, tmp_path):
    code = main(["compile", "llama-3.1-70b", "--hw", "laptop-8g", "--weight-dtype", "bf16", "-o",
                 str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("hetplan: error: no placement fits") and err.count("\n") == 1
    assert "Traceback" not in err


def test_gpu_memory_override_moves_weights_off_the_gpu():
    base = CompileRequest(model="llama-3.2-1b", hw="laptop-8g", weight_dtype="bf16")
    roomy, _ = compile_plan(base)
    assert {p["weights"] for p in roomy.placement} == {"gpu"}
    tight, _ = compile_plan(CompileRequest(**{**base.cli_args(), "gpu_mem": "1GiB"}))
    assert tight.memory["gpu_budget_bytes"] == GIB
    assert tight.memory["gpu_bytes"] <= GIB
    assert {p["weights"] for p in tight.placement} > {"gpu"}
    assert tight.predicted["tpot_s"] > roomy.predicted["tpot_s"]


def test_cpu_memory_override_sets_the_cpu_budget():
    plan, _ = compile_plan(CompileRequest(model="llama-3.2-1b", hw="laptop-8g", weight_dtype="bf16",
                                          cpu_mem="3GiB"))
    assert plan.memory["cpu_budget_bytes"] == 3 * GIB
    assert plan.memory["cpu_bytes"] <= 3 * GIB
