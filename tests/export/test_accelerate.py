"""`hetplan export --to accelerate`: the device map loads with transformers'
``from_pretrained(device_map=..., max_memory=...)`` for a tiny model saved here and places each
module as exported (``model.hf_device_map`` and the parameters' devices); read back with
`--strategy from-accelerate:FILE` it gives the plan's residence.

On a machine without a GPU the map's tiers are shifted down one (GPU -> "cpu", DRAM -> "disk")
so that Accelerate's own placement and offload hooks still run; on a CUDA machine the exported
map is loaded as written.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hetplan.compiler import CompileRequest, compile_plan  # noqa: E402
from hetplan.export.result import export  # noqa: E402
from tests.export.plans import residence, stated_plan  # noqa: E402
from tests.tiny_models import TINY_GPU_NODE  # noqa: E402

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                              tie_word_embeddings=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                     head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                     vocab_size=128, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(d / "model")
    (d / "node.yaml").write_text(TINY_GPU_NODE)
    return d


def place(b):
    """Layers 0-1 and the head offloaded; layer 3's routed experts (MoE) offloaded alone."""
    if b.kind == "head" or (b.layer is not None and b.layer < 2):
        return "stream", "gpu", 0 if b.kind == "moe" else None
    return "gpu", "gpu", 0 if b.kind == "moe" and b.layer == 3 else None


def exported_map(saved):
    plan = stated_plan(str(saved / "model" / "config.json"), str(saved / "node.yaml"), place)
    return plan, export(plan, "accelerate")


def test_the_device_map_loads_and_places_each_module_as_exported(saved):
    _, exported = exported_map(saved)
    doc = json.loads(exported.text)
    shifted = {m: "cpu" if d == 0 else "disk" for m, d in doc["device_map"].items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        saved / "model", device_map=shifted, max_memory={"cpu": doc["max_memory"]["cpu"]},
        offload_folder=str(saved / "offload"))
    assert {m: d for m, d in model.hf_device_map.items()} == shifted
    modules = dict(model.named_modules())
    for m, d in shifted.items():
        for p in modules[m].parameters():
            assert p.device.type == ("meta" if d == "disk" else "cpu"), (m, d, p.device)
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_device_map_loads_as_written_on_a_gpu(saved):
    _, exported = exported_map(saved)
    doc = json.loads(exported.text)
    max_memory = {int(k) if k.isdigit() else k: v for k, v in doc["max_memory"].items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(saved / "model", device_map=doc["device_map"],
                                                              max_memory=max_memory)
    assert model.hf_device_map == doc["device_map"]
    modules = dict(model.named_modules())
    for m, d in doc["device_map"].items():
        for p in modules[m].parameters():
            assert p.device.type == ("cuda" if d == 0 else "cpu") or (d == "cpu" and p.device.type == "meta"), (m, p.device)
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]], device="cuda")).logits.shape == (1, 3, 128)


def test_reading_the_map_back_gives_the_plans_residence(saved, tmp_path):
    plan, exported = exported_map(saved)
    path = tmp_path / "device_map.json"
    path.write_text(exported.text)
    back, _ = compile_plan(CompileRequest(model=str(saved / "model" / "config.json"), hw=str(saved / "node.yaml"),
                                          strategy=f"from-accelerate:{path}", weight_dtype="fp16",
                                          prompt_len=64, gen_len=16))
    assert residence(back) == residence(plan)
    offloaded = {p["block"] for p in plan.placement if p["weights"] != "gpu"}
    assert {b for b, e in back.decision().exec["decode"].items() if e != "gpu"} >= offloaded
