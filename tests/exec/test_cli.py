"""`hetplan exec` on the command line: what a run prints, what it writes, and how each kind of
bad input is refused (one line on stderr, exit code 2, nothing written)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.plan import write_atomic

NODE = """
name: cli-test-node
gpus: [{name: test gpu, memory: 1GiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}]
cpu: {name: cpu, cores: 2, memory: 4GiB, mem_bandwidth: 10GB/s, flops: {fp32: 100GFLOPS}}
links: {h2d: 10GB/s, d2h: 10GB/s}
reserve: {gpu: 1KiB, cpu: 1KiB}
"""
GEN_LEN = 5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("exec_cli")
    (root / "node.yaml").write_text(NODE)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                                   initializer_range=0.2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "model")
    vocab = {f"t{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(root / "model")
    plan, _ = compile_plan(CompileRequest(model=str(root / "model"), hw=str(root / "node.yaml"), strategy="stream",
                                          weight_dtype="fp32", prompt_len=4, gen_len=GEN_LEN))
    write_atomic(root / "plan.json", plan.to_json())
    return root


def run_cli(capsys, *args):
    rc = main(["exec", *map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def user_error(capsys, *args) -> str:
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert err.strip().splitlines()[-1].startswith("hetplan: error: ")
    return err.strip().splitlines()[-1]


def test_json_holds_tokens_metrics_and_peak_memory(files):
    proc = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(files / "plan.json"), "--weights", "random",
                           "--seed", "1", "--prompt-ids", "1,2,3,4", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert len(doc["tokens"]) == 1 and len(doc["tokens"][0]) == GEN_LEN
    assert all(0 <= t < 128 for t in doc["tokens"][0])
    assert set(doc["predicted"]) == {"ttft_s", "tpot_s", "decode_tokens_per_s"}
    assert set(doc["measured"]) == {"ttft_s", "cold_ttft_s", "tpot_s", "decode_tokens_per_s"}
    for side in ("measured", "predicted"):
        assert all(v > 0 for v in doc[side].values())
    # the GPU was emulated: its times are the CPU's, so no error against the plan's GPU is claimed
    assert doc["mode"] == "emulated" and doc["comparable"] is False
    assert all(v is None for v in doc["relative_error"].values())
    assert set(doc["peak_bytes"]) == {"gpu", "cpu"} and doc["peak_bytes"]["gpu"] > 0
    assert "decode 5/5 tokens" in proc.stderr  # progress on stderr, never on stdout
    assert "prefill 2/2 layers" in proc.stderr


def test_emulated_run_reports_its_times_as_not_comparable(files, capsys):
    rc, out, _ = run_cli(capsys, files / "plan.json", "--weights", "random", "--prompt-ids", "1,2,3,4")
    assert rc == 0
    assert "times not comparable with the plan: its GPU was emulated on the CPU" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("TTFT", "TPOT", "decode"))}
    assert "%" not in "".join(rows.values()) and "n/a" in rows["TPOT"]
    assert "TTFT (cold)" in out


def test_same_seed_same_tokens_different_seed_different_tokens(files, capsys):
    runs = {}
    for seed in (1, 1, 2):
        rc, out, _ = run_cli(capsys, files / "plan.json", "--weights", "random", "--seed", seed, "--temperature",
                             "1.0", "--json")
        assert rc == 0
        runs.setdefault(seed, []).append(json.loads(out)["tokens"])
    assert runs[1][0] == runs[1][1]
    assert runs[1][0] != runs[2][0]


def test_text_prompt_is_tokenised_and_output_decoded_with_the_tokenizer_beside_the_weights(files, capsys):
    rc, out, _ = run_cli(capsys, files / "plan.json", "--weights", files / "model", "--prompt", "t1 t2 t3 t4",
                         "--greedy", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["text"] == [" ".join(f"t{i}" for i in doc["tokens"][0])]


def test_trace_holds_measured_and_predicted_lanes(files, tmp_path, capsys):
    trace = tmp_path / "out.json"
    rc, out, _ = run_cli(capsys, files / "plan.json", "--weights", "random", "--trace", trace)
    assert rc == 0
    assert "TTFT" in out and "TPOT" in out and f"wrote {trace}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {1: "predicted prefill", 2: "predicted decode", 3: "measured prefill", 4: "measured decode"}
    measured = [e for e in events if e["ph"] == "X" and e["pid"] == 4]
    assert {e["cat"] for e in measured} >= {"load", "attn_in", "attn_core", "mlp", "head"}
    assert len(measured) == (GEN_LEN - 1) * len([e for e in events if e["ph"] == "X" and e["pid"] == 2])


def test_newer_schema_is_refused(files, tmp_path, capsys):
    doc = json.loads((files / "plan.json").read_text())
    doc["schema_version"] = 99
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert "schema_version 99 is newer" in user_error(capsys, tmp_path / "p.json", "--weights", "random")


def test_edited_plan_is_refused(files, tmp_path, capsys):
    doc = json.loads((files / "plan.json").read_text())
    doc["model"]["n_layers"] = 3
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert "fingerprint" in user_error(capsys, tmp_path / "p.json", "--weights", "random")


def test_truncated_plan_is_refused(files, tmp_path, capsys):
    text = (files / "plan.json").read_text()
    (tmp_path / "p.json").write_text(text[: len(text) // 2])
    assert "truncated" in user_error(capsys, tmp_path / "p.json", "--weights", "random")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_plan_on_a_machine_without_gpu_is_refused_unless_emulated(files, capsys):
    assert "--emulate" in user_error(capsys, files / "plan.json", "--weights", "random", "--no-emulate")


def test_plan_that_no_longer_fits_free_memory_is_refused_before_loading(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("hetplan.runtime.session.host_available_bytes", lambda: 1000)
    line = user_error(capsys, files / "plan.json", "--weights", "random", "--trace", tmp_path / "t.json")
    assert "only 1000 B is available" in line
    assert "loading" not in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_weights_of_another_model_are_refused(files, tmp_path, capsys):
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    line = user_error(capsys, files / "plan.json", "--weights", tmp_path, "--trace", tmp_path / "t.json")
    assert "'model.embed_tokens.weight'" in line and "[128, 32]" in line
    assert not (tmp_path / "t.json").exists()


def test_text_prompt_without_a_tokenizer_is_refused(files, capsys):
    assert "tokenizer" in user_error(capsys, files / "plan.json", "--weights", "random", "--prompt", "hello")


def test_plan_with_quantised_weights_and_kv_cache_runs(files, tmp_path, capsys):
    plan, _ = compile_plan(CompileRequest(model=str(files / "model"), hw=str(files / "node.yaml"), strategy="stream",
                                          weight_dtype="q4_k_m", kv_dtype="int8", prompt_len=4, gen_len=GEN_LEN))
    write_atomic(tmp_path / "q.json", plan.to_json())
    rc, out, err = run_cli(capsys, tmp_path / "q.json", "--weights", "random", "--prompt-ids", "1,2,3,4", "--json")
    assert rc == 0, err
    assert len(json.loads(out)["tokens"][0]) == GEN_LEN
