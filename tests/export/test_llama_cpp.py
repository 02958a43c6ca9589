"""`hetplan export --to llama.cpp`: every override regex matches exactly the tensors the plan puts
in host memory, among the tensor names ``gguf.GGUFReader`` reads back from a tiny GGUF written
here; re-reading the arguments (`--strategy from-llama.cpp:ARGS`) gives back the placement.

The oracle for what llama.cpp does with the arguments is written out here from llama.cpp's
rules (layer slots of -ngl, first matching -ot wins, --n-cpu-moe's per-layer pattern), apart
from hetplan's reader.
"""

from __future__ import annotations

import re
import shlex

import pytest
from gguf import GGUFReader

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.export.result import export
from tests.export.plans import residence, stated_plan
from tests.gguf.files import Dims, write_model
from tests.tiny_models import TINY_GPU_NODE

LAYERS = 12


def llama_cpp_on_gpu(names: list, args: str, n_layers: int) -> dict:
    """What llama.cpp does with ``args`` (llama-model.cpp, arg.cpp): name -> on the GPU?"""
    words, overrides, ngl = shlex.split(args), [], 0
    for i, w in enumerate(words):
        if w == "-ngl":
            ngl = int(words[i + 1])
        elif w == "-ot":
            for item in words[i + 1].split(","):
                pattern, _, buft = item.rpartition("=")
                overrides.append((pattern, buft != "CPU"))
        elif w == "--n-cpu-moe":
            overrides += [(rf"blk\.{l}\.ffn_(up|down|gate)_exps", False) for l in range(int(words[i + 1]))]
        elif w == "--cpu-moe":
            overrides.append((r"\.ffn_(up|down|gate)_exps", False))
    first = n_layers + 1 - min(ngl, n_layers + 1)
    out = {}
    for n in names:
        hit = [gpu for p, gpu in overrides if re.search(p, n)]
        if hit:
            out[n] = hit[0]
        elif n == "token_embd.weight":
            out[n] = False
        else:
            out[n] = (int(n.split(".")[1]) if n.startswith("blk.") else n_layers) >= first
    return out


def intended_on_gpu(names: list, plan) -> dict:
    """The plan's placement, per tensor: its block's residence (experts: the block's experts)."""
    by = {p["block"]: p for p in plan.placement}
    out = {}
    for n in names:
        if n == "token_embd.weight":
            out[n] = False  # llama.cpp keeps the table in host memory (said in the notes)
            continue
        if n.startswith("output"):
            p = by["head"]
        else:
            l, rest = n.split(".")[1], n.split(".", 2)[2]
            p = by.get(f"attn_{l}") if rest.startswith("attn_") else by.get(f"mlp_{l}") or by[f"moe_{l}"]
        hot = p.get("experts_on_gpu")
        out[n] = p["weights"] == "gpu" and not ("_exps." in n and hot is not None and hot == 0)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_cpp")
    (d / "node.yaml").write_text(TINY_GPU_NODE)
    write_model(d / "dense.gguf", "llama", dims=Dims(layers=LAYERS))
    write_model(d / "moe.gguf", "qwen3moe", dims=Dims(layers=6))
    return d


def dense_place(b):
    """Layers 0-3 whole in DRAM (copied up for the prompt), layer 10's MLP too; the head in DRAM,
    computed on the CPU (one sequence: llama.cpp multiplies its last position only, below op
    offload's batch); KV on the GPU."""
    if b.kind == "head":
        return "cpu", "gpu", None
    cpu = b.layer is not None and (b.layer < 4 or (b.layer == 10 and b.kind == "mlp"))
    return ("stream" if cpu else "gpu"), "gpu", None


def moe_place(b):
    """Experts of layers 1, 2 and 4 in DRAM (router and attention on the GPU), layer 5 whole."""
    if b.layer == 5 or b.kind == "embed":
        return "stream", "gpu", 0 if b.kind == "moe" else None
    return "gpu", "gpu", 0 if b.kind == "moe" and b.layer in (1, 2, 4) else None


@pytest.mark.parametrize("name,place", [("dense.gguf", dense_place), ("moe.gguf", moe_place)])
def test_every_override_matches_exactly_the_tensors_the_plan_puts_in_dram(files, name, place):
    plan = stated_plan(str(files / name), str(files / "node.yaml"), place)
    exported = export(plan, "llama.cpp")
    names = [t.name for t in GGUFReader(str(files / name)).tensors]
    assert llama_cpp_on_gpu(names, exported.text, plan.model.n_layers) == intended_on_gpu(names, plan)
    for w in shlex.split(exported.text):
        if "=" in w and w.startswith("^"):
            assert w.startswith("^blk\\.") or w.startswith("^output") or w.startswith("^(output")


def test_a_prefix_of_expert_layers_is_written_as_n_cpu_moe(files):
    plan = stated_plan(str(files / "moe.gguf"), str(files / "node.yaml"),
                       lambda b: ("gpu", "gpu", 0 if b.kind == "moe" and b.layer < 3 else None))
    words = shlex.split(export(plan, "llama.cpp").text)
    assert words[words.index("--n-cpu-moe") + 1] == "3" and "-ot" not in words


def test_layer_ranges_are_compact(files):
    plan = stated_plan(str(files / "dense.gguf"), str(files / "node.yaml"), dense_place)
    text = export(plan, "llama.cpp").text
    assert r"^blk\.[0-3]\.=CPU" in text and r"^blk\.10\.(ffn_|exp_probs_b\.)=CPU" in text


@pytest.mark.parametrize("name,place", [("dense.gguf", dense_place), ("moe.gguf", moe_place)])
def test_reading_the_arguments_back_gives_the_plans_placement(files, name, place):
    plan = stated_plan(str(files / name), str(files / "node.yaml"), place)
    exported = export(plan, "llama.cpp")
    back, _ = compile_plan(CompileRequest(model=str(files / name), hw=str(files / "node.yaml"),
                                          strategy=exported.strategy, prompt_len=64, gen_len=16))
    want = residence(plan)
    want["embed"] = (False, None, None)  # llama.cpp keeps the token embeddings in host memory
    assert residence(back) == want
    without_embed = lambda ex: {ph: {b: e for b, e in d.items() if b != "embed"} for ph, d in ex.items()}
    assert without_embed(back.decision().exec) == without_embed(plan.decision().exec)


def test_kv_in_dram_for_a_prefix_of_layers_is_written_with_ngl(files):
    plan = stated_plan(str(files / "dense.gguf"), str(files / "node.yaml"),
                       lambda b: ("stream" if b.layer is not None and b.layer < 5 or b.kind == "embed" else "gpu",
                                  "cpu" if b.layer is not None and b.layer < 5 else "gpu", None))
    words = shlex.split(export(plan, "llama.cpp").text)
    assert words[words.index("-ngl") + 1] == str(LAYERS + 1 - 5) and "-ot" not in words and "-nkvo" not in words


def test_a_model_llama_cpp_cannot_run_is_refused():
    from hetplan.export.result import CannotExpress
    plan, _ = compile_plan(CompileRequest(model="opt-30b", hw="t4-208g", strategy="ngl:0", prompt_len=64, gen_len=16))
    with pytest.raises(CannotExpress, match="llama.cpp has no architecture for opt"):
        export(plan, "llama.cpp")
