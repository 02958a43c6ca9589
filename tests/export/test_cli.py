"""`hetplan export` on the command line: the configuration alone on stdout (or in -o, written
whole), the report beside it, and one line with exit 2 for every mistake, nothing written."""

from __future__ import annotations

import shlex

import pytest

from tests.test_cli import hetplan, user_error
from tests.gguf.files import Dims, write_model
from tests.tiny_models import TINY_GPU_NODE


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("export_cli")
    (d / "node.yaml").write_text(TINY_GPU_NODE)
    write_model(d / "dense.gguf", "llama", dims=Dims(layers=6))
    write_model(d / "moe.gguf", "qwen3moe", dims=Dims(layers=4))
    for name, strategy in (("dense", "ngl:3"), ("moe", "n-cpu-moe:2")):
        proc = hetplan("compile", d / f"{name}.gguf", "--hw", d / "node.yaml", "--strategy", strategy,
                       "--prompt-len", 64, "--gen-len", 16, "-o", d / f"{name}.json")
        assert proc.returncode == 0, proc.stderr
    return d


@pytest.mark.parametrize("engine", ["llama.cpp", "accelerate", "vllm", "ktransformers"])
def test_export_writes_the_configuration_and_prices_it(work, engine, tmp_path):
    out = tmp_path / "config"
    proc = hetplan("export", work / "moe.json", "--to", engine, "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().strip()
    assert "plan (n-cpu-moe:2): TTFT" in proc.stdout and f"{engine} export: TTFT" in proc.stdout
    assert f"--strategy from-{engine}:{out}" in proc.stdout
    if engine in ("accelerate", "vllm"):  # they stream the experts the plan computes on the CPU in decode
        assert f"not expressed by {engine}:" in proc.stdout and "decode exec of moe (layer" in proc.stdout


def test_a_bad_output_path_is_refused_before_anything_is_written(work, tmp_path):
    assert "is a directory" in user_error("export", work / "dense.json", "--to", "llama.cpp", "-o", tmp_path)


def test_without_o_stdout_is_the_configuration_alone(work):
    proc = hetplan("export", work / "moe.json", "--to", "llama.cpp")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [proc.stdout.strip()]
    assert shlex.split(proc.stdout)[:2] == ["-ngl", "5"] and "--n-cpu-moe" in proc.stdout
    assert "llama.cpp export: TTFT" in proc.stderr


def test_reimported_llama_cpp_arguments_compile_to_the_same_prediction(work, tmp_path):
    args = tmp_path / "args.txt"
    assert hetplan("export", work / "dense.json", "--to", "llama.cpp", "-o", args).returncode == 0
    proc = hetplan("compile", work / "dense.gguf", "--hw", work / "node.yaml", "--prompt-len", 64, "--gen-len", 16,
                   "--strategy", f"from-llama.cpp:{args.read_text().strip()}", "-o", tmp_path / "back.json", "--json")
    assert proc.returncode == 0, proc.stderr
    import json
    back, plan = json.loads(proc.stdout), json.loads((work / "dense.json").read_text())
    assert back["predicted"]["tpot_s"] == pytest.approx(plan["predicted"]["tpot_s"], rel=1e-9)


def test_an_engine_that_can_express_nothing_writes_nothing(work, tmp_path):
    out = tmp_path / "rules.yaml"
    line = user_error("export", work / "dense.json", "--to", "ktransformers", "-o", out)
    assert "can express no part of this plan" in line
    assert not out.exists()


@pytest.mark.parametrize("strategy,says", [
    ("from-llama.cpp:-ngl 3 --mlock", "option '--mlock' is not one hetplan reads"),
    ("from-llama.cpp:-ngl 3 -ot 'blk\\.(=CPU'", "bad regular expression"),
    ("from-llama.cpp:-ngl 3 -ot blk=GPU9", "unknown buffer type 'GPU9'"),
    ("from-llama.cpp:-ngl x", "expected a non-negative integer"),
    ("from-llama.cpp:", "give the configuration after a colon"),
    ("from-accelerate:{\"model.layers.0\": 1", "not a JSON device map"),
    ("from-accelerate:{\"model.layers.99\": 0}", "names no module"),
    ("from-accelerate:{\"model.layers.0\": \"disk\"}", "hetplan reads 0"),
    ("from-vllm:--cpu-offload-gb lots", "expected a non-negative number"),
    ("from-vllm:--swap-space 4", "is not one hetplan reads"),
    ("from-vllm:--offload-group-size 2 --offload-params gate_up_proj down_proj", "offloads only the matching"),
    ("from-vllm:--cpu-offload-gb 1 --cpu-offload-params experts", "offloads only the matching"),
    ("from-vllm:--offload-group-size 2 --offload-prefetch-step 0", "requires at least 1"),
    ("from-vllm:--offload-group-size 2 --offload-num-in-group 3", "must be between 1 and"),
    ("from-vllm:--offload-backend disk --cpu-offload-gb 1", "vLLM's backends are auto, uva, prefetch"),
    ("from-ktransformers:/nonexistent/rules.yaml", "no such rule file"),
])
def test_bad_engine_configurations_are_one_line(work, tmp_path, strategy, says):
    out = tmp_path / "plan.json"
    line = user_error("compile", work / "dense.gguf", "--hw", work / "node.yaml", "--prompt-len", 64,
                      "--gen-len", 16, "--strategy", strategy, "-o", out)
    assert says in line
    assert not out.exists()


def test_an_unknown_engine_is_one_line(work):
    assert "--to" in user_error("export", work / "dense.json", "--to", "tgi")
