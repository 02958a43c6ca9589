"""Specification of the command line: compile, show, check, and how user mistakes are reported.

Every command runs as a real process (``python -m hetplan``) so exit codes, stdout purity and
the absence of tracebacks are what a user sees. Scenarios are small: llama-3.1-8b fits an RTX
4090 whole (its ILP solves in well under a second); baselines are used where a plan must spill.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.errors.workdir import error_lines

SMALL = ["llama-3.1-8b", "--hw", "rtx4090-64g"]
BASELINE_NAMES = ("all-gpu", "greedy", "ngl:", "ngl-nkvo:", "stream", "flexgen")


def hetplan(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def user_error(*args, cwd=None) -> str:
    """Run a command that must fail with a one-line user error; return that line."""
    proc = hetplan(*args, cwd=cwd)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    proc = hetplan("compile", *SMALL, "-o", out)
    assert proc.returncode == 0, proc.stderr
    return out


# -- compile ---------------------------------------------------------------------------------

def test_compile_writes_a_plan_and_summarises_it(small_plan):
    plan = json.loads(small_plan.read_text())
    assert plan["schema_version"] == 1 and plan["inputs"]["cli_args"]["model"] == "llama-3.1-8b"
    # 8B in bf16 is ~15 GiB of weights: the whole model fits the 23 GiB budget, all on the GPU
    assert {p["weights"] for p in plan["placement"]} == {"gpu"}


def test_compile_is_byte_identical_for_identical_inputs(small_plan, tmp_path):
    again = tmp_path / "again.json"
    assert hetplan("compile", *SMALL, "-o", again).returncode == 0
    assert again.read_bytes() == small_plan.read_bytes()


def test_compile_defaults_to_plan_json_in_the_current_directory(tmp_path):
    proc = hetplan("compile", "gpt2", "--hw", "rtx4090-64g", "--strategy", "all-gpu", cwd=tmp_path)
    assert proc.returncode == 0 and (tmp_path / "plan.json").is_file()
    assert proc.stdout.startswith("wrote plan.json: TTFT")


def test_json_flag_prints_one_object_and_nothing_else_on_stdout(tmp_path):
    out = tmp_path / "p.json"
    proc = hetplan("compile", *SMALL, "-o", out, "--json")
    assert proc.returncode == 0
    doc = json.loads(proc.stdout)
    assert set(doc) == {"path", "predicted", "memory", "solver", "notes"}
    assert doc["path"] == str(out) and doc["solver"]["solve_seconds"] >= 0
    assert doc["predicted"]["tpot_s"] == pytest.approx(json.loads(out.read_text())["predicted"]["tpot_s"])


def test_weight_dtype_auto_explains_its_choice_on_stderr_only(tmp_path):
    # llama-3.1-70b in bf16 is ~131 GiB; GPU 23 GiB + DRAM 60 GiB hold q8_0 (~70 GiB) but not bf16
    proc = hetplan("compile", "llama-3.1-70b", "--hw", "rtx4090-64g", "--strategy", "ngl", "--json",
                   "-o", tmp_path / "p.json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert "q8_0" in proc.stderr and "bf16" in proc.stderr
    assert any("q8_0" in n for n in doc["notes"])
    assert json.loads((tmp_path / "p.json").read_text())["model"]["weight_dtype"] == "q8_0"


def test_compare_prints_the_plan_beside_every_baseline(tmp_path):
    proc = hetplan("compile", *SMALL, "-o", tmp_path / "p.json", "--compare")
    assert proc.returncode == 0, proc.stderr
    rows = proc.stdout.split("\n\n", 1)[1].splitlines()
    assert rows[0].split()[:4] == ["strategy", "TTFT", "TPOT", "decode"]
    assert rows[1].startswith("ilp (chosen)")
    for name in BASELINE_NAMES:
        assert sum(r.startswith(name) for r in rows[2:]) == 1, name


def test_compare_json_says_which_baseline_does_not_fit_and_by_how_much(tmp_path):
    # llama-2-7b fp16: 6.74e9 params x 2 B = 13.5e9 B of weights, more than a 10 GiB GPU budget
    proc = hetplan("compile", "llama-2-7b", "--hw", "rtx4090-64g", "--gpu-mem", "10GiB", "--strategy", "ngl",
                   "--prompt-len", "128", "--gen-len", "16", "--compare", "--json", "-o", tmp_path / "p.json")
    assert proc.returncode == 0, proc.stderr
    rows = {r["strategy"].split(":")[0]: r for r in json.loads(proc.stdout)["compare"][1:]}
    assert set(rows) == {"all-gpu", "greedy", "ngl", "ngl-nkvo", "stream", "flexgen"}
    assert not rows["all-gpu"]["fits"] and rows["all-gpu"]["ratio_to_chosen"] is None
    assert rows["all-gpu"]["missing_bytes"]["gpu"] >= 13.4e9 - 10 * 2**30
    assert rows["ngl"]["fits"] and rows["greedy"]["fits"]


def test_dump_lp_writes_the_milp(tmp_path):
    proc = hetplan("compile", *SMALL, "-o", tmp_path / "p.json", "--dump-lp", tmp_path / "m.lp")
    assert proc.returncode == 0, proc.stderr
    dumped = sorted(p.name for p in tmp_path.glob("m*.lp"))
    assert dumped and all("Subject To" in (tmp_path / n).read_text() for n in dumped)


def test_help_documents_every_option_with_units_and_defaults():
    text = hetplan("compile", "--help").stdout
    for option in ("--hw", "--strategy", "--objective", "--batch", "--prompt-len", "--gen-len", "--weight-dtype",
                   "--kv-dtype", "--gpu-mem", "--cpu-mem", "--time-limit", "--max-nodes", "--dump-lp", "--compare",
                   "--json"):
        assert option in text
    from hetplan.compiler import CompileRequest
    req = CompileRequest(model="m", hw="n")
    assert f"default: {req.time_limit_s}" in text and f"default: {req.max_nodes}" in text
    assert "default: 512" in text and "20GiB" in text and "Examples:" in text


# -- user mistakes ---------------------------------------------------------------------------

def test_unknown_model_preset_lists_the_known_ones():
    line = user_error("compile", "llama-9", "--hw", "rtx4090-64g")
    assert "llama-9" in line and "llama-3.1-8b" in line and "mixtral-8x7b" in line


def test_unknown_node_lists_the_known_presets():
    line = user_error("compile", "gpt2", "--hw", "dgx-9000")
    assert "dgx-9000" in line and "rtx4090-64g" in line


def test_malformed_node_yaml_names_file_and_line(tmp_path):
    (tmp_path / "node.yaml").write_text("name: box\ngpus:\n  - name: x\n   memory: [\n")
    line = user_error("compile", "gpt2", "--hw", "node.yaml", cwd=tmp_path)
    assert "node.yaml:4" in line


def test_a_value_with_a_bad_unit_names_its_key(tmp_path):
    (tmp_path / "node.yaml").write_text(
        "gpus: [{name: g, memory: 24 Gigs, mem_bandwidth: 1TB/s, flops: {fp16: 100TFLOPS}}]\n"
        "cpu: {memory: 64GiB, mem_bandwidth: 50GB/s, flops: {fp32: 1TFLOPS}}\nlinks: {h2d: 25GB/s}\n")
    line = user_error("compile", "gpt2", "--hw", "node.yaml", cwd=tmp_path)
    assert "gpus[0].memory" in line and "24 Gigs" in line
    assert "--cpu-mem" in user_error("compile", "gpt2", "--hw", "rtx4090-64g", "--cpu-mem", "lots")


@pytest.mark.parametrize("flag", ["--batch", "--prompt-len", "--gen-len"])
def test_non_positive_workload_sizes_are_refused(flag):
    assert flag in user_error("compile", "gpt2", "--hw", "rtx4090-64g", flag, "0")


def test_a_model_that_cannot_fit_says_how_many_bytes_are_missing(tmp_path):
    line = user_error("compile", "llama-3.1-70b", "--hw", "laptop-8g", "--weight-dtype", "bf16",
                      "-o", tmp_path / "p.json")
    assert "missing" in line and "GiB" in line and "a machine with" in line


def test_a_failed_compile_leaves_an_existing_plan_untouched_and_no_partial_file(small_plan, tmp_path):
    out = tmp_path / "plan.json"
    out.write_bytes(small_plan.read_bytes())
    user_error("compile", "llama-3.1-70b", "--hw", "laptop-8g", "--weight-dtype", "bf16", "-o", out)
    assert out.read_bytes() == small_plan.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    fresh = tmp_path / "new" / "plan.json"
    user_error("compile", "llama-3.1-70b", "--hw", "laptop-8g", "--weight-dtype", "bf16", "-o", fresh)
    assert not fresh.exists()


def test_show_of_a_truncated_plan_names_the_file(small_plan, tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text(small_plan.read_text()[:500])
    line = user_error("show", bad)
    assert str(bad) in line and "malformed JSON" in line


# -- show ------------------------------------------------------------------------------------

def test_show_summarises_blocks_memory_predictions_and_solver(small_plan):
    proc = hetplan("show", small_plan)
    assert proc.returncode == 0
    out = proc.stdout
    # 32 identical layers collapse to one row per kind
    assert "attn_0..attn_31  32  gpu" in out and "mlp_0..mlp_31    32  gpu" in out
    for word in ("budget", "lower bound", "bottleneck", "status optimal"):
        assert word in out


def test_show_draws_svg_and_png_timelines_and_writes_a_trace(small_plan, tmp_path):
    svg, png, trace = tmp_path / "t.svg", tmp_path / "t.png", tmp_path / "t.json"
    assert hetplan("show", small_plan, "--timeline", svg, "--trace", trace).returncode == 0
    assert svg.read_text().startswith("<svg") and "traceEvents" in json.loads(trace.read_text())
    pytest.importorskip("matplotlib")
    assert hetplan("show", small_plan, "--timeline", png).returncode == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


# -- check -----------------------------------------------------------------------------------

def test_check_passes_an_unchanged_plan_with_one_ok_line(small_plan):
    proc = hetplan("check", small_plan)
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and proc.stdout.startswith(f"OK {small_plan}")


def test_check_fails_on_a_regression_and_update_accepts_it(small_plan, tmp_path):
    golden = tmp_path / "golden.json"
    doc = json.loads(small_plan.read_text())
    doc["predicted"]["tpot_s"] *= 0.9   # the checked-in plan promised a faster decode step
    golden.write_text(json.dumps(doc))
    proc = hetplan("check", tmp_path)
    assert proc.returncode == 1 and f"FAIL {golden}" in proc.stdout and "tpot_s" in proc.stdout
    assert hetplan("check", golden, "--update").returncode == 0
    assert golden.read_bytes() == small_plan.read_bytes()
    assert hetplan("check", golden).returncode == 0


def test_check_of_a_missing_path_is_a_user_error(tmp_path):
    assert "no such plan file" in user_error("check", tmp_path / "nope.json")


# -- README ----------------------------------------------------------------------------------

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_rows() -> dict:
    """First cell (a `preset`) -> the row's cells, for every table row of README.md."""
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    return rows


def test_readme_model_table_matches_the_presets():
    from hetplan.frontends.resolve import load_model
    from hetplan.presets.models import MODEL_PRESETS
    rows = readme_rows()
    for name in MODEL_PRESETS:
        spec = load_model(name)
        assert rows[name][1:4] == [spec.arch, f"{spec.total_params() / 1e9:.1f}B", str(spec.n_layers)], name


def test_readme_node_table_matches_the_presets():
    import yaml
    from hetplan.presets.nodes import NODE_PRESETS
    rows = readme_rows()
    for name, text in NODE_PRESETS.items():
        node = yaml.safe_load(text)
        gpu = (node.get("gpus") or [None])[0]
        each = " each" if len(node.get("gpus") or []) > 1 else ""
        assert rows[name][2] == (gpu["memory"] + each if gpu else "-"), name
        assert rows[name][5:7] == [node["cpu"]["memory"], node["cpu"]["mem_bandwidth"]], name


def test_readme_quick_start_is_two_commands_that_compile_show_and_test():
    text = README.read_text()
    block = text.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    first, second = block.strip().splitlines()
    assert "hetplan compile" in first and "hetplan show" in first
    assert "torch==2.13.0" in second and second.endswith("pytest")


def test_the_printed_compile_time_includes_building_the_problem(monkeypatch):
    """Building the problem is slowed by 0.3 s: the reported compile time counts it, the solver's
    own time does not."""
    import time

    from hetplan import compiler
    from hetplan.compiler import CompileRequest, compile_plan

    build = compiler.build_problem

    def slow_build(*args, **kwargs):
        time.sleep(0.3)
        return build(*args, **kwargs)

    monkeypatch.setattr(compiler, "build_problem", slow_build)
    _, took = compile_plan(CompileRequest(model="gpt2", hw="rtx4090-64g"))
    assert took.wall_s >= 0.3 and took.solve_s < took.wall_s - 0.3 + 1e-9
    assert took.cpu_s >= 0


@pytest.mark.parametrize("strategy,needle", [("flexgen:101", "must be 0 to 100"), ("flexgen:x", "W (the GPU weight")])
def test_a_bad_flexgen_percent_is_one_line_naming_it(tmp_path, strategy, needle):
    line = user_error("compile", *SMALL, "--strategy", strategy, "-o", tmp_path / "p.json")
    assert strategy in line and needle in line
    assert not (tmp_path / "p.json").exists()
