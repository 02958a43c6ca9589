"""Compiling MoE models from the command line: expert-level plans, ``--routing``, the MoE
baselines in ``--compare``, recompiling a plan without its routing file, and bad input.

A tiny Mixtral-shaped config (2 layers of 8 experts, 2 per token) on a node whose GPU holds
about half of the experts keeps every ILP solve well under a second.
"""

import json
import subprocess
import sys

import pytest

from hetplan.frontends.resolve import load_model
from hetplan.routing import routing_fingerprint
from tests.errors.workdir import error_lines

CONFIG = {"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8000,
          "max_position_embeddings": 4096, "num_local_experts": 8, "num_experts_per_tok": 2,
          "torch_dtype": "float16"}
NODE = """
name: half-experts
gpus: [{name: small gpu, memory: 130MiB, mem_bandwidth: 500GB/s, flops: {fp16: 50TFLOPS, fp32: 10TFLOPS}}]
cpu: {name: cpu, cores: 8, memory: 4GiB, mem_bandwidth: 50GB/s, flops: {fp32: 1TFLOPS, bf16: 1TFLOPS}}
links: {h2d: 16GB/s}
reserve: {gpu: 1KiB, cpu: 1KiB}
"""
SKEW = [0.05, 0.1, 0.6, 0.05, 0.5, 0.1, 0.4, 0.2]  # hottest: 2, 4, 6, 7, then 1 and 5 (tie), 0 and 3


def hetplan(*args):
    proc = subprocess.run([sys.executable, "-m", "hetplan", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(CONFIG))
    (d / "node.yaml").write_text(NODE)
    spec = load_model(str(d / "model"))
    (d / "skewed.json").write_text(json.dumps({"model_fingerprint": routing_fingerprint(spec),
                                               "layers": {"0": SKEW, "1": SKEW[::-1]}}))
    return d


@pytest.fixture(scope="module")
def skewed_plan(files):
    out = files / "skewed-plan.json"
    proc = hetplan("compile", files / "model", "--hw", files / "node.yaml", "--prompt-len", "128",
                   "--gen-len", "32", "--routing", files / "skewed.json", "-o", out)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_the_plan_keeps_each_layers_hottest_experts_on_the_gpu(skewed_plan):
    moe = [p for p in skewed_plan["placement"] if p["kind"] == "moe"]
    split = [p for p in moe if p["weights"] == "gpu" and 0 < p["experts_on_gpu"] < 8]
    assert split, f"the budget should force a split: {[(p['weights'], p['experts_on_gpu']) for p in moe]}"
    for p in moe:
        if p["weights"] != "gpu":
            continue
        fractions = SKEW if p["layer"] == 0 else SKEW[::-1]
        ranked = sorted(range(8), key=lambda e: (-fractions[e], e))
        assert p["gpu_experts"] == sorted(ranked[:p["experts_on_gpu"]])
    kinds = {t["kind"] for t in skewed_plan["schedule"]["decode"]["tasks"]}
    assert {"moe_route", "moe_experts", "moe_cold", "moe_merge"} <= kinds


def test_the_plan_records_its_routing_and_recompiles_without_the_file(files, skewed_plan, tmp_path):
    assert skewed_plan["inputs"]["cli_args"]["routing"]["layers"]["0"] == SKEW
    copy = tmp_path / "plan.json"
    copy.write_text((files / "skewed-plan.json").read_text())
    (tmp_path / "elsewhere").mkdir()
    proc = subprocess.run([sys.executable, "-m", "hetplan", "check", str(copy)], capture_output=True, text=True,
                          cwd=tmp_path / "elsewhere", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical" in proc.stdout


def test_uniform_routing_gives_another_plan(files, skewed_plan, tmp_path):
    out = tmp_path / "uniform.json"
    proc = hetplan("compile", files / "model", "--hw", files / "node.yaml", "--prompt-len", "128",
                   "--gen-len", "32", "-o", out)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert "routing" not in plan["inputs"]["cli_args"]
    hot = {p["block"]: p.get("gpu_experts") for p in plan["placement"] if p["kind"] == "moe"}
    assert hot != {p["block"]: p.get("gpu_experts") for p in skewed_plan["placement"] if p["kind"] == "moe"}


def test_compare_lists_the_moe_baselines(files, tmp_path):
    proc = hetplan("compile", files / "model", "--hw", files / "node.yaml", "--prompt-len", "128",
                   "--gen-len", "32", "--compare", "--json", "-o", tmp_path / "p.json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["compare"]
    names = [r["strategy"].split(":")[0] for r in rows[1:]]
    assert names == ["all-gpu", "greedy", "ngl", "ngl-nkvo", "stream", "flexgen", "cpu-moe", "n-cpu-moe", "ktransformers"]
    fitting = [r for r in rows[1:] if r["fits"]]
    assert all(rows[0]["ttft_s"] + 32 * rows[0]["tpot_s"] <= (r["ttft_s"] + 32 * r["tpot_s"]) * (1 + 1e-6)
               for r in fitting)


@pytest.mark.parametrize("strategy", ["cpu-moe", "n-cpu-moe:1", "ktransformers"])
def test_moe_baselines_compile(files, tmp_path, strategy):
    out = tmp_path / "p.json"
    # a GPU with 1 GiB usable (--gpu-mem may not exceed the card, so the node itself is larger)
    big = tmp_path / "big.yaml"
    big.write_text(NODE.replace("memory: 130MiB", "memory: 1100MiB"))
    proc = hetplan("compile", files / "model", "--hw", big, "--gpu-mem", "1GiB",
                   "--prompt-len", "128", "--gen-len", "32", "--strategy", strategy, "-o", out)
    assert proc.returncode == 0, proc.stderr
    hot = [p["experts_on_gpu"] for p in json.loads(out.read_text())["placement"] if p["kind"] == "moe"]
    assert hot == ([0, 8] if strategy == "n-cpu-moe:1" else [0, 0])


def user_error(*args) -> str:
    proc = hetplan(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), proc.stderr
    return lines[0]


def test_moe_baselines_on_a_dense_model_say_why(tmp_path):
    line = user_error("compile", "llama-3.1-8b", "--hw", "rtx4090-64g", "--strategy", "cpu-moe",
                      "-o", tmp_path / "p.json")
    assert "has no experts" in line and not (tmp_path / "p.json").exists()


def test_a_bad_layer_count_is_refused():
    assert "N must be a non-negative integer" in user_error("compile", "mixtral-8x7b", "--hw", "rtx4090-64g",
                                                            "--strategy", "n-cpu-moe:x")


def test_routing_of_another_model_is_refused(files, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_fingerprint": "0123456789abcdef", "layers": {}}))
    line = user_error("compile", files / "model", "--hw", files / "node.yaml", "--routing", other,
                      "-o", tmp_path / "p.json")
    assert "fingerprint" in line and "--record-routing" in line


def test_a_missing_routing_file_is_a_user_error(files, tmp_path):
    line = user_error("compile", files / "model", "--hw", files / "node.yaml", "--routing", tmp_path / "no.json",
                      "-o", tmp_path / "p.json")
    assert "no.json" in line
