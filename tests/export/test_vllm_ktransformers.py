"""`hetplan export --to vllm` and `--to ktransformers`: the options each writes, and re-reading
them (`--strategy from-vllm:ARGS`, `from-ktransformers:FILE`) gives back the plan's placement.

Expected option values are derived here from the plan's stated placement and the engines'
documented rules (UVA offloads the first layers' bytes; the prefetch offloader offloads layer
``i`` when ``i mod N >= N - K``; a kTransformers rule's name regex is searched in the module name).
"""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.export.result import CannotExpress, export
from tests.export.plans import residence, stated_plan
from tests.gguf.files import Dims, write_model
from tests.tiny_models import TINY_GPU_NODE

GIB = 2 ** 30


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    (d / "node.yaml").write_text(TINY_GPU_NODE)
    write_model(d / "dense.gguf", "llama", dims=Dims(layers=8))
    write_model(d / "moe.gguf", "qwen3moe", dims=Dims(layers=6))
    return d


def recompile(files, model, strategy):
    plan, _ = compile_plan(CompileRequest(model=str(files / model), hw=str(files / "node.yaml"), strategy=strategy,
                                          prompt_len=64, gen_len=16))
    return plan


def test_vllm_offloads_the_first_layers_bytes_with_cpu_offload_gb(files):
    plan = stated_plan(str(files / "dense.gguf"), str(files / "node.yaml"),
                       lambda b: ("stream" if b.layer is not None and b.layer < 3 else "gpu", "gpu", None))
    words = shlex.split(export(plan, "vllm").text)
    gib = float(words[words.index("--cpu-offload-gb") + 1])
    off = [p["weight_bytes"] for p in plan.placement if p["layer"] is not None and p["layer"] < 3]
    assert sum(off) - off[-1] < gib * GIB <= sum(off)
    back = recompile(files, "dense.gguf", export(plan, "vllm").strategy)
    assert residence(back) == residence(plan)
    assert all(back.decision().exec["decode"][p["block"]] == "stream" for p in plan.placement if p["weights"] != "gpu")


def test_vllm_writes_the_prefetch_offloader_for_every_other_layer_streamed_ahead(files):
    plan = stated_plan(str(files / "dense.gguf"), str(files / "node.yaml"),
                       lambda b: ("stream" if b.layer is not None and b.layer % 2 == 1 else "gpu", "gpu", None), depth=2)
    text = export(plan, "vllm").text
    words = shlex.split(text)
    assert words[words.index("--offload-group-size") + 1] == "2"
    assert words[words.index("--offload-num-in-group") + 1] == "1"
    assert words[words.index("--offload-prefetch-step") + 1] == "1"
    back = recompile(files, "dense.gguf", f"from-vllm:{text.strip()}")
    assert residence(back) == residence(plan) and back.staging["depth"] == 2


def moe_place(b):
    return "gpu", "gpu", 0 if b.kind == "moe" and b.layer in (0, 1, 4) else None


def test_ktransformers_rules_put_exactly_the_planned_layers_experts_on_the_cpu(files):
    plan = stated_plan(str(files / "moe.gguf"), str(files / "node.yaml"), moe_place)
    rules = yaml.safe_load(export(plan, "ktransformers").text)
    modules = [f"model.layers.{l}.mlp.experts" for l in range(6)]

    def first_rule(name):
        return next(r for r in rules if "name" in r["match"] and re.search(r["match"]["name"], name)
                    and "class" not in r["match"])

    on_cpu = {m for m in modules if first_rule(m)["replace"]["kwargs"]["generate_device"] == "cpu"}
    assert on_cpu == {f"model.layers.{l}.mlp.experts" for l in (0, 1, 4)}
    assert all(first_rule(m)["replace"]["kwargs"]["prefill_device"] == "cpu" for m in on_cpu)


def test_ktransformers_rules_read_back_give_the_plans_placement(files, tmp_path):
    plan = stated_plan(str(files / "moe.gguf"), str(files / "node.yaml"), moe_place)
    path = tmp_path / "rules.yaml"
    path.write_text(export(plan, "ktransformers").text)
    back = recompile(files, "moe.gguf", f"from-ktransformers:{path}")
    want = residence(plan)
    assert residence(back) == want


def test_ktransformers_cannot_express_a_dense_model(files):
    plan = stated_plan(str(files / "dense.gguf"), str(files / "node.yaml"), lambda b: ("gpu", "gpu", None))
    with pytest.raises(CannotExpress, match="has none"):
        export(plan, "ktransformers")


@pytest.mark.parametrize("engine", ["vllm", "ktransformers"])
def test_an_engine_needing_a_gpu_cannot_express_a_cpu_only_plan(files, engine):
    node = files / "cpu-node.yaml"
    node.write_text("\n".join(line for line in TINY_GPU_NODE.splitlines() if not line.startswith("gpus:")))
    plan = recompile_on(files, "moe.gguf", node)
    with pytest.raises(CannotExpress, match="nothing was written"):
        export(plan, engine)


def recompile_on(files, model, node):
    plan, _ = compile_plan(CompileRequest(model=str(files / model), hw=str(node), prompt_len=64, gen_len=16))
    return plan
