"""Where the runtime's weights come from: checkpoints (one file, or shards with an index),
refused when they are not the plan's model, memory-mapped rather than copied into DRAM, and
seeded random weights that transformers reproduces with the same values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.runtime.backend import backend_for
from hetplan.runtime.devices import Devices
from hetplan.runtime.lookup import lookup
from hetplan.runtime.residency import Residency
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.runtime.weights import Checkpoint, random_state_dict

NODE = """
name: weights-test-node
gpus: [{name: test gpu, memory: 1GiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS, bf16: 20TFLOPS}}]
cpu: {name: cpu, cores: 2, memory: 4GiB, mem_bandwidth: 10GB/s, flops: {fp32: 100GFLOPS, bf16: 100GFLOPS}}
links: {h2d: 10GB/s, d2h: 10GB/s}
reserve: {gpu: 1KiB, cpu: 1KiB}
"""
PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def llama_config(intermediate: int = 96) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                    max_position_embeddings=128, initializer_range=0.2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    (root / "node.yaml").write_text(NODE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(llama_config()).eval()
    model.save_pretrained(root / "single", safe_serialization=True)
    return root, model


def plan_for(model_dir, node, strategy="ngl:1", weight_dtype="fp32"):
    req = CompileRequest(model=str(model_dir), hw=str(node), strategy=strategy, weight_dtype=weight_dtype,
                         prompt_len=len(PROMPT), gen_len=4)
    return compile_plan(req)[0]


def run(plan, weights, **kw):
    opts = dict(weights=str(weights), prompt_ids=(PROMPT,), all_logits=True, keep_logits=True)
    return run_plan(plan, RunOptions(**{**opts, **kw}))


def test_checkpoint_logits_match_transformers(setup):
    root, model = setup
    result = run(plan_for(root / "single", root / "node.yaml"), root / "single")
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits
    assert (result.logits[0] - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_with_index_runs_like_the_single_file(setup):
    root, _ = setup
    state = load_file(root / "single" / "model.safetensors")
    sharded = root / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((root / "single" / "config.json").read_text())
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, part in shards.items():
        save_file({n: state[n] for n in part}, sharded / fname)
    weight_map = {n: fname for fname, part in shards.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    plan = plan_for(root / "single", root / "node.yaml")
    one, two = run(plan, root / "single"), run(plan, sharded)
    assert torch.equal(one.logits[0], two.logits[0])
    assert one.tokens == two.tokens


def test_checkpoint_of_another_shape_is_refused_naming_the_first_mismatching_tensor(setup, tmp_path):
    root, _ = setup
    wider = tmp_path / "wider"
    transformers.AutoModelForCausalLM.from_config(llama_config(intermediate=128)).save_pretrained(wider)
    plan = plan_for(wider, root / "node.yaml")
    # Block order is embed, attn_0, mlp_0: the first tensor whose shape depends on the MLP width.
    with pytest.raises(HetplanError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight'.*\[96, 64\].*\[128, 64\]"):
        run(plan, root / "single")


def test_checkpoint_of_another_dtype_is_refused(setup):
    root, _ = setup
    plan = plan_for(root / "single", root / "node.yaml", weight_dtype="bf16")
    with pytest.raises(HetplanError, match=r"'model\.embed_tokens\.weight'.* fp32.* bf16"):
        run(plan, root / "single")


def test_checkpoint_missing_a_tensor_is_refused(setup, tmp_path):
    root, _ = setup
    state = load_file(root / "single" / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    plan = plan_for(root / "single", root / "node.yaml")
    with pytest.raises(HetplanError, match=r"no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        run(plan, tmp_path)


def test_truncated_checkpoint_is_refused(setup, tmp_path):
    root, _ = setup
    data = (root / "single" / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(HetplanError, match="truncated"):
        Checkpoint(tmp_path)


def test_loading_holds_the_weights_once_and_unmaps_the_checkpoint(setup):
    """Each block's tensors land in one buffer of exactly its weight bytes, but a block of lookup
    tables in DRAM (the token embedding), read from the file a row at a time; no view of the
    memory-mapped files outlives loading (unmapping raises BufferError while one exists), and
    the process maps no part of the checkpoint afterwards."""
    root, model = setup
    plan = plan_for(root / "single", root / "node.yaml", strategy="ngl:1")
    source = Checkpoint(root / "single")
    residency = Residency(plan, backend_for(plan.model), source, Devices("emulated", plan.memory["gpu_budget_bytes"]),
                          torch.float32, torch.float32, batch=1, max_tokens=8)
    assert source._maps  # the checkpoint was read through its mapping
    source.close()
    assert not source._maps
    assert str((root / "single" / "model.safetensors").resolve()) not in Path("/proc/self/maps").read_text()
    tables = {p["block"] for p in plan.placement if p["kind"] == "embed" and p["weights"] == "cpu"}
    assert tables == {"embed"}  # ngl:1 keeps the embedding in DRAM
    for p in plan.placement:
        placed = residency.blocks[p["block"]].flat.numel() * 4
        assert placed == (0 if p["block"] in tables else p["weight_bytes"])
    tok = residency.blocks["embed"].tensors["tok"]
    ids = torch.tensor([[5, 0, 127, 5]])
    assert torch.equal(lookup(tok, ids), model.model.embed_tokens.weight[ids])
    placed = sum(b.flat.numel() for b in residency.blocks.values())
    assert placed == sum(t.numel() for t in model.parameters()) - model.model.embed_tokens.weight.numel()


def test_a_table_read_from_the_file_looks_rows_up_as_torch_does(setup):
    """``FileTable``: rows, repeated ids, any shape of ids, slices, an empty lookup; an id outside
    the table is an IndexError as ``F.embedding``'s is."""
    root, model = setup
    source = Checkpoint(root / "single")
    spec = next(t for t in backend_for(plan_for(root / "single", root / "node.yaml").model).block_tensors("embed", "embed", None)
                if t.local == "tok")
    table, ref = source.table(spec), model.model.embed_tokens.weight
    for ids in (torch.tensor([3]), torch.tensor([[1, 1, 2], [127, 0, 1]]), torch.tensor([], dtype=torch.long)):
        assert torch.equal(lookup(table, ids), torch.nn.functional.embedding(ids, ref))
    assert torch.equal(table[10:13], ref[10:13]) and table[5:5].shape == (0, 64)
    with pytest.raises(IndexError):
        lookup(table, torch.tensor([128]))
    with pytest.raises(IndexError):
        lookup(table, torch.tensor([-1]))


def test_random_weights_are_what_transformers_computes_with_the_same_values(setup):
    root, _ = setup
    plan = plan_for(root / "single", root / "node.yaml")
    result = run(plan, "random", seed=3)
    blocks = [(p["block"], p["kind"], p["layer"]) for p in plan.placement]
    state = random_state_dict(backend_for(plan.model), blocks, torch.float32, seed=3)
    model = transformers.AutoModelForCausalLM.from_config(llama_config()).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits
    assert (result.logits[0] - ref).abs().max().item() <= 1e-4


def test_random_weights_depend_on_the_seed_not_on_the_placement(setup):
    root, _ = setup
    a = run(plan_for(root / "single", root / "node.yaml", strategy="all-gpu"), "random", seed=5)
    b = run(plan_for(root / "single", root / "node.yaml", strategy="stream"), "random", seed=5)
    c = run(plan_for(root / "single", root / "node.yaml", strategy="all-gpu"), "random", seed=6)
    assert (a.logits[0] - b.logits[0]).abs().max().item() <= 1e-5
    assert (a.logits[0] - c.logits[0]).abs().max().item() > 1e-3


def test_fused_projection_views_are_the_projections_back_to_back(setup):
    root, _ = setup
    plan = plan_for(root / "single", root / "node.yaml", strategy="stream")
    residency = Residency(plan, backend_for(plan.model), Checkpoint(root / "single"),
                          Devices("emulated", plan.memory["gpu_budget_bytes"]), torch.float32, torch.float32,
                          batch=1, max_tokens=8)
    slot = next(t.slot for t in plan.schedule["decode"].tasks if t.kind == "load" and t.block == "attn_0")
    residency.load("attn_0", slot)
    for where in (residency.blocks["attn_0"].tensors, residency.weights("attn_0", "gpu", slot)):
        assert where["qkv"].shape == (64 + 32 + 32, 64)
        assert where["qkv"].data_ptr() == where["q"].data_ptr()
        assert torch.equal(where["qkv"], torch.cat([where["q"], where["k"], where["v"]]))
    mlp = residency.blocks["mlp_0"].tensors
    assert mlp["gate_up"].data_ptr() == mlp["gate"].data_ptr()
    assert torch.equal(mlp["gate_up"], torch.cat([mlp["gate"], mlp["up"]]))
