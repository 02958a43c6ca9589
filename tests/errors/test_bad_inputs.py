"""A table of mistakes across compile, show, check, exec and profile.

Each row must end the same way: exit code 2, exactly one line on stderr (``hetplan: error: ...``),
no traceback, and every file in the working directory byte-identical (and of the same kind and
mode) before and after.
"""

from __future__ import annotations

import json
import os
import stat

import pytest

from tests.errors.workdir import CONFIG, MOE_CONFIG, NODE, error_lines, populate, run, snapshot


def node(old: str, new: str) -> dict:
    assert old in NODE, old
    return {"bad.yaml": NODE.replace(old, new)}


def config(**changes) -> dict:
    cfg = {k: v for k, v in dict(CONFIG, **changes).items() if v is not None}
    return {"bad.json": json.dumps(cfg)}


def plan_edit(edit) -> callable:
    def make(plan: dict) -> dict:
        d = json.loads(json.dumps(plan))
        edit(d)
        return {"bad_plan.json": json.dumps(d)}
    return make


def plan_redigest(edit) -> callable:
    """A plan edited by hand and given a matching digest: only the schema stands between it and
    the commands (the digest check cannot catch it)."""
    def make(plan: dict) -> dict:
        from hetplan.plan.format import content_digest
        d = json.loads(json.dumps(plan))
        edit(d)
        d["digest"] = content_digest(d)
        return {"bad_plan.json": json.dumps(d, indent=1)}
    return make


def routing(edit) -> dict:
    from hetplan.frontends.hf_config import spec_from_config
    from hetplan.routing import routing_fingerprint
    doc = {"model_fingerprint": routing_fingerprint(spec_from_config(MOE_CONFIG)), "tokens": 8,
           "layers": {"0": [0.5, 0.5, 0.5, 0.5]}}
    edit(doc)
    return {"r.json": json.dumps(doc, indent=1)}


PROFILE = {"schema_version": 1, "machine": {"cpu_model": "x", "cpu_count": 2, "memory_bytes": 8 << 30, "gpus": []},
           "info": {}, "entries": [{"device": "cpu", "op": "mlp", "dtype": "fp32", "shape": "d64",
                                    "points": [{"x": 1.0, "seconds": 1e-4}]}], "transfers": {}}


def profile(edit) -> dict:
    doc = json.loads(json.dumps(PROFILE))
    edit(doc)
    return {"bad.yaml": NODE + "profile: p.json\n", "p.json": json.dumps(doc, indent=1)}


def alias_bomb(levels: int = 8) -> str:
    """A YAML value whose nested aliases stand for 10**(levels + 1) strings (a billion at 8)."""
    value = "&l0 [x, x, x, x, x, x, x, x, x, x]"
    for k in range(1, levels + 1):
        value = f"&l{k} [" + ", ".join([value] + [f"*l{k - 1}"] * 9) + "]"
    return value


COMPILE_NODE = ["compile", "config.json", "--hw", "bad.yaml", "-o", "out.json"]
COMPILE_CFG = ["compile", "bad.json", "--hw", "node.yaml", "-o", "out.json"]
COMPILE = ["compile", "config.json", "--hw", "node.yaml", "-o", "out.json"]
COMPILE_MOE = ["compile", "moe.json", "--hw", "node.yaml", "-o", "out.json"]

CASES = [
    # -- node.yaml --------------------------------------------------------------------------
    ("node-unknown-top-key", COMPILE_NODE, node("name: tiny\n", "name: tiny\ngpu_count: 2\n"), "gpu_count"),
    ("node-unknown-gpu-key", COMPILE_NODE, node("    memory: 2GiB\n", "    memory: 2GiB\n    colour: red\n"), "colour"),
    ("node-unknown-cpu-key", COMPILE_NODE, node("  cores: 2\n", "  cores: 2\n  numa_nodes: 2\n"), "numa_nodes"),
    ("node-unknown-links-key", COMPILE_NODE, node("{h2d: 10GB/s}", "{h2d: 10GB/s, pcie: 4}"), "pcie"),
    ("node-unknown-flops-key", COMPILE_NODE, node("{fp32: 1TFLOPS}", "{fp32: 1TFLOPS, fp64: 1TFLOPS}"), "fp64"),
    ("node-scalar-reserve", COMPILE_NODE, node("reserve: {gpu: 1KiB, cpu: 1KiB}", "reserve: 3GiB"), "reserve"),
    ("node-bare-gpu-memory", COMPILE_NODE, node("memory: 2GiB", "memory: 24"), "no unit"),
    ("node-bare-h2d", COMPILE_NODE, node("{h2d: 10GB/s}", "{h2d: 25}"), "GB/s"),
    ("node-bare-cpu-bandwidth", COMPILE_NODE, node("mem_bandwidth: 20GB/s", "mem_bandwidth: 20"), "no unit"),
    ("node-bare-string-size", COMPILE_NODE, node("memory: 8GiB", "memory: '8'"), "no unit"),
    ("node-only-fp8-flops", COMPILE_NODE, node("{fp32: 10TFLOPS, bf16: 20TFLOPS}", "{fp8: 20TFLOPS}"), "fp32, fp16 or bf16"),
    ("node-gpu-larger-than-sold", COMPILE_NODE, node("memory: 2GiB", "memory: 100TiB"), "no GPU sold"),
    ("node-link-faster-than-built", COMPILE_NODE, node("{h2d: 10GB/s}", "{h2d: 10TB/s}"), "link"),
    ("node-negative-memory", COMPILE_NODE, node("memory: 2GiB", "memory: -2GiB"), "memory"),
    ("node-zero-memory", COMPILE_NODE, node("memory: 2GiB", "memory: 0GiB"), "positive"),
    ("node-unit-typo", COMPILE_NODE, node("memory: 2GiB", "memory: 2 furlongs"), "cannot read"),
    ("node-bool-bandwidth", COMPILE_NODE, node("mem_bandwidth: 100GB/s", "mem_bandwidth: true"), "mem_bandwidth"),
    ("node-efficiency-above-one", COMPILE_NODE, node("reserve:", "efficiency: {link: 1.5}\nreserve:"), "(0, 1]"),
    ("node-efficiency-string", COMPILE_NODE, node("reserve:", "efficiency: {link: high}\nreserve:"), "efficiency.link"),
    ("node-efficiency-unknown", COMPILE_NODE, node("reserve:", "efficiency: {pcie: 0.5}\nreserve:"), "pcie"),
    ("node-negative-latency", COMPILE_NODE, node("reserve:", "latency: {gpu_task: -1}\nreserve:"), "latency.gpu_task"),
    ("node-negative-cores", COMPILE_NODE, node("cores: 2", "cores: -1"), "cores"),
    ("node-string-cores", COMPILE_NODE, node("cores: 2", "cores: many"), "cores"),
    ("node-list-name", COMPILE_NODE, node("name: tiny", "name: [a, b]"), "name"),
    ("node-gpus-mapping", COMPILE_NODE, node("gpus:\n  - name: test gpu", "gpus:\n  x:\n    name: test gpu"), "gpus"),
    ("node-missing-cpu", COMPILE_NODE, {"bad.yaml": NODE[:NODE.index("cpu:")] + "links: {h2d: 10GB/s}\n"}, "cpu"),
    ("node-missing-links", COMPILE_NODE, node("links: {h2d: 10GB/s}\n", ""), "links"),
    ("node-reserve-exceeds-gpu", COMPILE_NODE, node("{gpu: 1KiB, cpu: 1KiB}", "{gpu: 3GiB, cpu: 1KiB}"), "reserve.gpu"),
    ("node-duplicate-key", COMPILE_NODE, node("  cores: 2\n", "  cores: 2\n  cores: 4\n"), "twice"),
    ("node-binary", COMPILE_NODE, {"bad.yaml": b"\xff\xfe\x00\x01garbage"}, "not a text file"),
    ("node-malformed-yaml", COMPILE_NODE, {"bad.yaml": NODE + "latency: {gpu_task: 1\n  x: [\n"}, "malformed YAML"),
    ("node-top-level-list", COMPILE_NODE, {"bad.yaml": "- a\n- b\n"}, "mapping"),
    ("node-empty", COMPILE_NODE, {"bad.yaml": ""}, "mapping"),
    ("node-negative-price", COMPILE_NODE, node("reserve:", "price: {per_hour: -1}\nreserve:"), "price.per_hour"),
    ("node-price-unknown-key", COMPILE_NODE, node("reserve:", "price: {per_day: 1}\nreserve:"), "per_day"),
    ("node-missing-profile", COMPILE_NODE, node("reserve:", "profile: nowhere.profile.json\nreserve:"), "nowhere"),
    ("node-preset-typo", ["compile", "config.json", "--hw", "rtx4090", "-o", "out.json"], {}, "known presets"),
    # -- config.json ------------------------------------------------------------------------
    ("config-negative-intermediate", COMPILE_CFG, config(intermediate_size=-128), "intermediate_size"),
    ("config-zero-layers", COMPILE_CFG, config(num_hidden_layers=0), "num_hidden_layers"),
    ("config-string-hidden", COMPILE_CFG, config(hidden_size="64"), "hidden_size"),
    ("config-float-hidden", COMPILE_CFG, config(hidden_size=64.5), "hidden_size"),
    ("config-bool-heads", COMPILE_CFG, config(num_attention_heads=True), "num_attention_heads"),
    ("config-unknown-type", COMPILE_CFG, config(model_type="bert"), "not supported"),
    ("config-list-type", COMPILE_CFG, config(model_type=["llama"]), "model_type"),
    ("config-missing-vocab", COMPILE_CFG, config(vocab_size=None), "vocab_size"),
    ("config-absurd-hidden", COMPILE_CFG, config(hidden_size=10**12), "hidden_size"),
    ("config-unknown-dtype", COMPILE_CFG, config(torch_dtype="float8"), "torch_dtype"),
    ("config-heads-do-not-divide", COMPILE_CFG, config(num_key_value_heads=3), "divide"),
    ("config-negative-eps", COMPILE_CFG, config(rms_norm_eps=-1e-6), "rms_norm_eps"),
    ("config-binary", COMPILE_CFG, {"bad.json": b"\x89PNG\r\n\x1a\n\x00\x00"}, "not a text file"),
    ("config-malformed", COMPILE_CFG, {"bad.json": '{"model_type": "llama",\n "hidden_size": }'}, "malformed JSON"),
    ("config-array", COMPILE_CFG, {"bad.json": "[1, 2]"}, "JSON object"),
    ("config-deep-nesting", COMPILE_CFG, {"bad.json": "[" * 100000 + "]" * 100000}, "bad.json"),
    ("config-missing-file", ["compile", "nowhere.json", "--hw", "node.yaml", "-o", "out.json"], {}, "nowhere.json"),
    ("config-moe-too-many-chosen", ["compile", "bad.json", "--hw", "node.yaml", "-o", "out.json"],
     {"bad.json": json.dumps(dict(MOE_CONFIG, num_experts_per_tok=9))}, "num_experts_per_tok"),
    # -- compile options --------------------------------------------------------------------
    ("gpu-mem-bare", COMPILE + ["--gpu-mem", "20"], {}, "no unit"),
    ("gpu-mem-above-card", COMPILE + ["--gpu-mem", "100GiB"], {}, "more than"),
    ("cpu-mem-unreadable", COMPILE + ["--cpu-mem", "lots"], {}, "--cpu-mem"),
    ("batch-zero", COMPILE + ["--batch", "0"], {}, "--batch"),
    ("prompt-negative", COMPILE + ["--prompt-len", "-1"], {}, "--prompt-len"),
    ("prompt-beyond-positions", COMPILE + ["--prompt-len", "100000"], {}, "max_position_embeddings"),
    ("strategy-unknown", COMPILE + ["--strategy", "magic"], {}, "unknown strategy"),
    ("strategy-moe-on-dense", COMPILE + ["--strategy", "cpu-moe"], {}, "cpu-moe"),
    ("strategy-bad-count", COMPILE + ["--strategy", "ngl:x"], {}, "ngl:x"),
    ("weight-dtype-unknown", COMPILE + ["--weight-dtype", "int3"], {}, "int3"),
    ("kv-dtype-unknown", COMPILE + ["--kv-dtype", "fp7"], {}, "fp7"),
    ("time-limit-zero", COMPILE + ["--time-limit", "0"], {}, "--time-limit"),
    ("mip-gap-above-one", COMPILE + ["--mip-gap", "2"], {}, "--mip-gap"),
    ("output-missing-dir", ["compile", "config.json", "--hw", "node.yaml", "-o", "no/such/dir/p.json"], {}, "does not exist"),
    ("output-is-dir", ["compile", "config.json", "--hw", "node.yaml", "-o", "sub"], {"sub/keep.txt": "x"}, "directory"),
    ("output-is-fifo", ["compile", "config.json", "--hw", "node.yaml", "-o", "pipe"], {"pipe": "FIFO"}, "FIFO"),
    ("nothing-fits", COMPILE + ["--gpu-mem", "16KiB", "--cpu-mem", "16KiB"], {}, "no placement fits"),
    ("routing-missing", COMPILE_MOE + ["--routing", "no.json"], {}, "no.json"),
    ("routing-malformed", COMPILE_MOE + ["--routing", "r.json"], {"r.json": "{"}, "malformed JSON"),
    ("routing-wrong-model", COMPILE_MOE + ["--routing", "r.json"],
     {"r.json": json.dumps({"model_fingerprint": "0" * 16, "layers": {}})}, "r.json"),
    ("routing-unknown-key", COMPILE_MOE + ["--routing", "r.json"],
     {"r.json": json.dumps({"model_fingerprint": "0" * 16, "layers": {}, "colour": 1})}, "colour"),
    # -- show -------------------------------------------------------------------------------
    ("show-missing", ["show", "nowhere.json"], {}, "no such plan"),
    ("show-truncated", ["show", "bad_plan.json"], lambda plan: {"bad_plan.json": json.dumps(plan)[:500]}, "malformed JSON"),
    ("show-newer-schema", ["show", "bad_plan.json"], plan_edit(lambda d: d.update(schema_version=99)), "newer"),
    ("show-edited", ["show", "bad_plan.json"], plan_edit(lambda d: d["predicted"].update(ttft_s=0.0)), "edited"),
    ("show-binary", ["show", "bad_plan.json"], {"bad_plan.json": b"\xff\x00\xfe"}, "bad_plan.json"),
    ("show-list", ["show", "bad_plan.json"], {"bad_plan.json": "[]"}, "not a hetplan plan"),
    ("show-timeline-format", ["show", "plan.json", "--timeline", "p.gif"], {}, "svg or .png"),
    ("show-timeline-missing-dir", ["show", "plan.json", "--timeline", "no/dir/p.svg"], {}, "does not exist"),
    ("show-trace-is-dir", ["show", "plan.json", "--trace", "sub"], {"sub/keep.txt": "x"}, "directory"),
    # -- check ------------------------------------------------------------------------------
    ("check-missing", ["check", "nowhere.json"], {}, "no such plan"),
    ("check-empty-dir", ["check", "sub"], {"sub/keep.txt": "x"}, "no *.json"),
    ("check-negative-tolerance", ["check", "plan.json", "--tolerance", "-1"], {}, "--tolerance"),
    ("check-unreadable-plan", ["check", "bad_plan.json"], {"bad_plan.json": "{"}, "could not be checked"),
    ("check-unknown-cli-arg", ["check", "bad_plan.json"],
     plan_edit(lambda d: d["inputs"]["cli_args"].update(colour=1)), "could not be checked"),
    # -- exec -------------------------------------------------------------------------------
    ("exec-missing-plan", ["exec", "nowhere.json", "--weights", "random"], {}, "no such plan"),
    ("exec-greedy-and-temperature", ["exec", "plan.json", "--greedy", "--temperature", "1"], {}, "--greedy"),
    ("exec-zero-temperature", ["exec", "plan.json", "--temperature", "0"], {}, "--temperature"),
    ("exec-zero-gen-len", ["exec", "plan.json", "--gen-len", "0"], {}, "--gen-len"),
    ("exec-no-weights", ["exec", "plan.json"], {}, "--weights"),
    ("exec-missing-weights", ["exec", "plan.json", "--weights", "no_ckpt"], {}, "no_ckpt"),
    ("exec-trace-is-dir", ["exec", "plan.json", "--weights", "random", "--trace", "sub"], {"sub/keep.txt": "x"}, "directory"),
    ("exec-bad-prompt-ids", ["exec", "plan.json", "--weights", "random", "--prompt-ids", "a,b"], {}, "prompt"),
    ("exec-edited-plan", ["exec", "bad_plan.json", "--weights", "random"],
     plan_edit(lambda d: d["memory"].update(gpu_bytes=1)), "edited"),
    # -- profile ----------------------------------------------------------------------------
    ("profile-profile-without-trace", ["profile", "--profile", "x.json"], {}, "--from-trace"),
    ("profile-bad-budget", ["profile", "--budget", "forever"], {}, "budget"),
    ("profile-missing-trace", ["profile", "--from-trace", "no.json", "--profile", "p.json", "--plan", "plan.json"], {}, "no.json"),
    ("profile-out-missing-dir", ["profile", "--out", "no/dir/node.yaml", "--budget", "5s"], {}, "does not exist"),
    # -- classes found re-walking the list ---------------------------------------------------
    ("plan-unknown-deep-key", ["show", "bad_plan.json"],
     plan_redigest(lambda d: d["schedule"]["decode"]["tasks"][0].update(colour=1)), "accepted: ['block'"),
    ("plan-bad-tier", ["show", "bad_plan.json"], plan_redigest(lambda d: d["placement"][0].update(weights="disk")),
     "placement[0].weights"),
    ("plan-negative-bytes", ["show", "bad_plan.json"], plan_redigest(lambda d: d["memory"].update(gpu_bytes=-1.0)),
     "memory.gpu_bytes"),
    ("plan-absurd-seconds", ["show", "bad_plan.json"], plan_redigest(lambda d: d["predicted"].update(tpot_s=1e300)),
     "predicted.tpot_s"),
    ("plan-nan", ["show", "bad_plan.json"], plan_redigest(lambda d: d["predicted"].update(ttft_s=float("nan"))),
     "predicted.ttft_s"),
    ("plan-string-batch", ["exec", "bad_plan.json", "--weights", "random"],
     plan_redigest(lambda d: d["workload"].update(batch="1")), "workload.batch"),
    ("plan-edge-to-nowhere", ["exec", "bad_plan.json", "--weights", "random"],
     plan_redigest(lambda d: d["schedule"]["prefill"]["edges"].append(["embed/embed", "x"])), "names a task"),
    ("plan-unknown-resource", ["exec", "bad_plan.json", "--weights", "random"],
     plan_redigest(lambda d: d["schedule"]["decode"]["tasks"][0].update(resource="tpu")), "resource"),
    ("plan-row-dropped", ["show", "bad_plan.json"], plan_redigest(lambda d: d["placement"].pop(1)),
     "placement does not list"),
    ("plan-kv-on-mlp", ["show", "bad_plan.json"], plan_redigest(lambda d: d["placement"][2].update(kv="gpu")), "'kv'"),
    ("plan-ends-before-start", ["show", "bad_plan.json"],
     plan_redigest(lambda d: d["schedule"]["prefill"]["tasks"][0].update(start_s=5.0, end_s=1.0)), "before it starts"),
    ("plan-hw-absurd-link", ["show", "bad_plan.json"],
     plan_redigest(lambda d: d["hardware"].update(h2d_bytes_per_s=1e15)), "hardware.h2d_bytes_per_s"),
    ("plan-cli-args-unknown", ["check", "bad_plan.json"],
     plan_redigest(lambda d: d["inputs"]["cli_args"].update(colour=1)), "could not be checked"),
    ("plan-non-utf8-exec", ["exec", "bad_plan.json", "--weights", "random"], {"bad_plan.json": b"{\xff}"}, "not UTF-8"),
    ("plan-non-utf8-check", ["check", "bad_plan.json"], {"bad_plan.json": b"\xfe\xff"}, "could not be checked"),
    ("routing-string-fraction", COMPILE_MOE + ["--routing", "r.json"],
     routing(lambda d: d["layers"].update({"0": ["0.5"] * 4})), "layers.0[0]"),
    ("routing-bad-layer-key", COMPILE_MOE + ["--routing", "r.json"],
     routing(lambda d: d["layers"].update({"-1": [0.5] * 4})), "not a layer index"),
    ("routing-bool-tokens", COMPILE_MOE + ["--routing", "r.json"], routing(lambda d: d.update(tokens=True)), "tokens"),
    ("routing-short-fingerprint", COMPILE_MOE + ["--routing", "r.json"],
     routing(lambda d: d.update(model_fingerprint="abc")), "model_fingerprint"),
    ("routing-non-utf8", COMPILE_MOE + ["--routing", "r.json"], {"r.json": b"\xff\xfe{}"}, "not UTF-8"),
    ("config-typo-of-read-key", COMPILE_CFG, config(num_hiden_layers=2), "did you mean 'num_hidden_layers'"),
    ("config-string-bool", COMPILE_CFG, config(tie_word_embeddings="false"), "tie_word_embeddings"),
    ("config-string-rope-theta", COMPILE_CFG, config(rope_theta="fast"), "rope_theta"),
    ("config-rope-scaling-unknown", COMPILE_CFG, config(rope_scaling={"rope_type": "linear", "factr": 2}), "factr"),
    ("config-list-act", COMPILE_CFG, config(hidden_act=["silu"]), "hidden_act"),
    ("config-null-model-type", COMPILE_CFG, {"bad.json": json.dumps(dict(CONFIG, model_type=None))}, "model_type"),
    ("profile-unknown-key", COMPILE_NODE, profile(lambda d: d["entries"][0].update(colour=1)), "colour"),
    ("profile-bad-device", COMPILE_NODE, profile(lambda d: d["entries"][0].update(device="tpu")), "entries[0].device"),
    ("profile-string-seconds", COMPILE_NODE, profile(lambda d: d["entries"][0]["points"][0].update(seconds="1ms")),
     "seconds"),
    ("profile-zero-seconds", COMPILE_NODE, profile(lambda d: d["entries"][0]["points"][0].update(seconds=0.0)),
     "impossible values"),
    ("profile-absurd-memory", COMPILE_NODE, profile(lambda d: d["machine"].update(memory_bytes=2**60)), "machine.memory_bytes"),
    ("profile-non-utf8", COMPILE_NODE, {"bad.yaml": NODE + "profile: p.json\n", "p.json": b"\xff"}, "not UTF-8"),
    ("output-symlink-to-dir", ["compile", "config.json", "--hw", "node.yaml", "-o", "link.json"],
     {"sub/keep.txt": "x", "link.json": "SYMLINK:sub"}, "directory"),
    ("record-routing-is-dir", ["exec", "plan.json", "--weights", "random", "--record-routing", "sub"],
     {"sub/keep.txt": "x"}, "directory"),
    ("timeline-is-fifo", ["show", "plan.json", "--timeline", "pipe.svg"], {"pipe.svg": "FIFO"}, "FIFO"),
    ("profile-out-is-dir", ["profile", "--out", "sub", "--budget", "5s"], {"sub/keep.txt": "x"}, "directory"),
    ("time-limit-nan", COMPILE + ["--time-limit", "nan"], {}, "--time-limit"),
    ("time-limit-absurd", COMPILE + ["--time-limit", "1e300"], {}, "--time-limit"),
    ("max-nodes-absurd", COMPILE + ["--max-nodes", str(10**20)], {}, "--max-nodes"),
    ("exec-infinite-temperature", ["exec", "plan.json", "--weights", "random", "--temperature", "inf"], {},
     "--temperature"),
    ("profile-absurd-budget", ["profile", "--budget", "100000000m"], {}, "--budget"),
    # -- classes: empty values, '-' for a file, paths that print on two lines, files that are
    #    not files, another hetplan file where one kind is expected, numbers out of range -------
    ("empty-size-flag", COMPILE + ["--cpu-mem", ""], {}, "must not be empty"),
    ("empty-dtype-flag", COMPILE + ["--weight-dtype", ""], {}, "must not be empty"),
    ("empty-weights", ["exec", "plan.json", "--weights", ""], {}, "must not be empty"),
    ("empty-profile-out", ["profile", "--out", "", "--budget", "5s"], {}, "must not be empty"),
    ("empty-model-argument", ["compile", "", "--hw", "node.yaml", "-o", "out.json"], {}, "must not be empty"),
    ("output-dash", COMPILE + ["-o", "-"], {}, "not standard output"),
    ("trace-dash", ["exec", "plan.json", "--weights", "random", "--trace", "-"], {}, "not standard output"),
    ("profile-out-dash", ["profile", "--out", "-", "--budget", "5s"], {}, "not standard output"),
    ("timeline-dash", ["show", "plan.json", "--trace", "-"], {}, "not standard output"),
    ("output-newline-in-path", COMPILE + ["-o", "a\nb/p.json"], {}, "a\\nb"),
    ("model-not-utf8-name", ["compile", "\udcff.json", "--hw", "node.yaml", "-o", "out.json"], {}, "\\udcff"),
    ("show-a-directory", ["show", "sub"], {"sub/keep.txt": "x"}, "is a directory, not a file"),
    ("show-a-fifo", ["show", "pipe"], {"pipe": "FIFO"}, "is a FIFO, not a file"),
    ("model-a-fifo", ["compile", "pipe", "--hw", "node.yaml", "-o", "out.json"], {"pipe": "FIFO"}, "is a FIFO"),
    ("hw-a-fifo", ["compile", "config.json", "--hw", "pipe", "-o", "out.json"], {"pipe": "FIFO"}, "is a FIFO"),
    ("hw-a-directory", ["compile", "config.json", "--hw", "sub", "-o", "out.json"], {"sub/keep.txt": "x"},
     "is a directory"),
    ("routing-a-fifo", COMPILE_MOE + ["--routing", "pipe"], {"pipe": "FIFO"}, "is a FIFO"),
    ("hw-is-a-plan", ["compile", "config.json", "--hw", "plan.json", "-o", "out.json"], {}, "looks like a plan"),
    ("routing-is-a-plan", COMPILE_MOE + ["--routing", "plan.json"], {}, "looks like a plan"),
    ("routing-is-a-config", COMPILE_MOE + ["--routing", "moe.json"], {}, "looks like a model's config.json"),
    ("model-is-a-plan", ["compile", "plan.json", "--hw", "node.yaml", "-o", "out.json"], {}, "looks like a plan"),
    ("show-a-node-yaml", ["show", "node.yaml"], {}, "is YAML"),
    ("exec-a-node-yaml", ["exec", "node.yaml", "--weights", "random"], {}, "is YAML"),
    ("check-a-node-yaml", ["check", "node.yaml"], {}, "could not be checked"),
    ("prefill-chunk-beyond-prompt", COMPILE + ["--prefill-chunk", "99999999999"], {}, "more than the prompt"),
    ("strategy-colon-without-count", COMPILE + ["--strategy", "ngl:"], {}, "N is missing"),
    ("check-infinite-tolerance", ["check", "plan.json", "--tolerance", "inf"], {}, "finite"),
    ("exec-seed-too-large", ["exec", "plan.json", "--weights", "random", "--seed", str(2**70)], {}, "--seed"),
    ("exec-negative-seed", ["exec", "plan.json", "--weights", "random", "--seed", "-1"], {}, "--seed"),
    ("exec-empty-prompt-id", ["exec", "plan.json", "--weights", "random", "--prompt-ids", "1,,2"], {}, "--prompt-ids"),
    ("exec-trailing-comma-prompt", ["exec", "plan.json", "--weights", "random", "--prompt-ids", "1,"], {},
     "--prompt-ids"),
    ("batch-not-an-integer", COMPILE + ["--batch", "1e3"], {}, "--batch"),
    ("gpu-mem-a-rate", COMPILE + ["--gpu-mem", "20GB/s"], {}, "--gpu-mem"),
    ("gpu-mem-infinite", COMPILE + ["--gpu-mem", "1e400GiB"], {}, "--gpu-mem"),
    ("batch-absurd", COMPILE + ["--batch", str(10**23)], {}, "at most 16777216"),
    ("imported-nan-offload", COMPILE + ["--strategy", "from-vllm:--cpu-offload-gb nan"], {}, "a finite one"),
    ("imported-infinite-offload", COMPILE + ["--strategy", "from-vllm:--cpu-offload-gb 1e999"], {}, "a finite one"),
    ("imported-rules-a-fifo", COMPILE + ["--strategy", "from-ktransformers:pipe"], {"pipe": "FIFO"}, "pipe"),
    ("gguf-a-directory", ["compile", "x.gguf", "--hw", "node.yaml", "-o", "out.json"], {"x.gguf/keep.txt": "x"},
     "is a directory"),
    ("gguf-a-fifo", ["compile", "x.gguf", "--hw", "node.yaml", "-o", "out.json"], {"x.gguf": "FIFO"}, "is a FIFO"),
    ("exec-weights-gguf-fifo", ["exec", "plan.json", "--weights", "x.gguf"], {"x.gguf": "FIFO"}, "x.gguf"),
    ("node-empty-profile", COMPILE_NODE, node("reserve:", "profile: ''\nreserve:"), "must not be empty"),
    ("node-blank-gpu-name", COMPILE_NODE, node("name: test gpu", "name: ' '"), "gpus[0].name"),
    ("node-profile-is-a-plan", COMPILE_NODE, {"bad.yaml": NODE + "profile: plan.json\n"}, "looks like a plan"),
    ("node-profile-a-directory", COMPILE_NODE, {"bad.yaml": NODE + "profile: sub\n", "sub/keep.txt": "x"},
     "is a directory"),
    ("fold-trace-a-fifo", ["profile", "--from-trace", "pipe", "--profile", "p.json", "--plan", "plan.json"],
     {"pipe": "FIFO"}, "is a FIFO"),
    ("fold-trace-not-utf8", ["profile", "--from-trace", "t.json", "--profile", "p.json", "--plan", "plan.json"],
     {"t.json": b"\xff\xfe"}, "not UTF-8"),
    ("output-onto-the-model", ["compile", "config.json", "--hw", "node.yaml", "-o", "config.json"], {},
     "is the MODEL this command reads"),
    ("output-onto-the-node", ["compile", "config.json", "--hw", "node.yaml", "-o", "node.yaml"], {}, "--hw"),
    ("output-onto-the-routing", COMPILE_MOE[:-1] + ["r.json", "--routing", "r.json"],
     {"r.json": "{}"}, "--routing"),
    ("trace-onto-the-plan", ["exec", "plan.json", "--weights", "random", "--trace", "plan.json"], {},
     "is the PLAN"),
    ("trace-and-routing-same-file", ["exec", "plan.json", "--weights", "random", "--trace", "t.json",
                                     "--record-routing", "t.json"], {}, "both write"),
    ("timeline-onto-the-plan", ["show", "plan.json", "--trace", "plan.json"], {}, "is the PLAN"),
    ("timeline-and-trace-same-file", ["show", "plan.json", "--timeline", "p.svg", "--trace", "p.svg"], {},
     "both write"),
    ("export-onto-the-plan", ["export", "plan.json", "--to", "llama.cpp", "-o", "plan.json"], {}, "is the PLAN"),
    ("dump-lp-without-milp", COMPILE + ["--dump-lp", "m.lp", "--strategy", "all-gpu"], {}, "solves none"),
    ("stream-cold-experts-on-dense", COMPILE + ["--stream-cold-experts"], {}, "no experts"),
    ("node-alias-bomb", COMPILE_NODE, node("name: tiny", "name: " + alias_bomb()), "aliases"),
    ("ktransformers-rules-alias-bomb", COMPILE_MOE + ["--strategy", "from-ktransformers:rules.yaml"],
     {"rules.yaml": "- " + alias_bomb()}, "aliases"),
    ("config-5000-digit-number", COMPILE_CFG, {"bad.json": json.dumps(CONFIG).replace('"hidden_size": 64',
                                                                              '"hidden_size": ' + "9" * 5000)},
     "not a hetplan file"),
    ("plan-5000-digit-number", ["show", "bad_plan.json"],
     lambda plan: {"bad_plan.json": json.dumps(plan).replace('"schema_version": 1', '"schema_version": 1' + "0" * 5000)},
     "not a hetplan file"),
    ("accelerate-map-5000-digit-number", COMPILE + ["--strategy", "from-accelerate:map.json"],
     {"map.json": '{"model.embed_tokens": ' + "1" * 5000 + "}"}, "from-accelerate"),
    ("time-limit-before-any-plan", COMPILE + ["--time-limit", "1e-300"], {}, "before it found any plan"),
    ("export-to-dash", ["export", "plan.json", "--to", "llama.cpp", "-o", "-"], {}, "not standard output"),
    ("export-empty-output", ["export", "plan.json", "--to", "llama.cpp", "-o", ""], {}, "must not be empty"),
    ("export-a-node-yaml", ["export", "node.yaml", "--to", "llama.cpp"], {}, "is YAML"),
    ("export-a-fifo", ["export", "pipe", "--to", "llama.cpp"], {"pipe": "FIFO"}, "is a FIFO"),
    ("export-missing-engine", ["export", "plan.json"], {}, "Choose from: llama.cpp, accelerate"),
    ("gen-len-absurd", COMPILE + ["--gen-len", str(10**9)], {}, "--gen-len"),
    ("prefill-chunk-absurd", COMPILE + ["--prompt-len", str(10**9), "--prefill-chunk", str(10**9)], {},
     "--prompt-len"),
]


def test_the_table_covers_every_command_with_at_least_80_mistakes():
    assert len(CASES) >= 80
    assert {argv[0] for _, argv, _, _ in CASES} == {"compile", "show", "check", "exec", "profile", "export"}
    assert len({name for name, *_ in CASES}) == len(CASES)


@pytest.mark.parametrize("name,argv,files,says", CASES, ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_exit_2_and_touches_nothing(name, argv, files, says, good_plan, tmp_path,
                                                           monkeypatch, capsys):
    populate(tmp_path, good_plan)
    if callable(files):
        files = files(json.loads(good_plan))
    for rel, content in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if content == "FIFO":
            os.mkfifo(p)
        elif isinstance(content, str) and content.startswith("SYMLINK:"):
            p.symlink_to(content[len("SYMLINK:"):])
        elif isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    code, out, err = run(argv, capsys)
    assert code == 2, (code, out, err)
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("hetplan: error: "), err
    assert "Traceback" not in err + out
    assert says in lines[0], lines[0]
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_output_to_a_device_is_refused_and_the_device_stays_a_device(tmp_path, monkeypatch, capsys):
    populate(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["compile", "config.json", "--hw", "node.yaml", "-o", "/dev/null"], capsys)
    assert code == 2 and "is a device" in err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


ENV_CASES = [
    ("HETPLAN_NATIVE_KERNELS", "maybe", ["compile", "config.json", "--hw", "node.yaml", "-o", "out.json"]),
    ("HETPLAN_TRACEBACK", "sometimes", ["show", "plan.json"]),
    ("HETPLAN_CPU_16BIT", "fast", ["exec", "plan.json", "--weights", "random"]),
    ("HETPLAN_CPU_UPCAST", "always", ["profile", "--out", "node.yaml", "--budget", "5s"]),
    ("HETPLAN_CACHE", "/dev/null", ["exec", "plan.json", "--weights", "random"]),
    ("HETPLAN_CACHE", " ", ["check", "plan.json"]),
    ("HETPLAN_JOBS", "0", ["compile", "config.json", "--hw", "node.yaml", "-o", "out.json"]),
    ("HETPLAN_JOBS", "many", ["check", "plan.json"]),
]


@pytest.mark.parametrize("name,value,argv", ENV_CASES, ids=[f"{n}={v!r}" for n, v, _ in ENV_CASES])
def test_a_bad_hetplan_environment_variable_is_one_line_exit_2(name, value, argv, good_plan, tmp_path,
                                                               monkeypatch, capsys):
    populate(tmp_path, good_plan)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    before = snapshot(tmp_path)
    code, out, err = run(argv, capsys)
    lines = error_lines(err)
    assert code == 2 and len(lines) == 1 and name in lines[0] and repr(value) in lines[0], (code, err)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), ("OFF", False), ("no", False),
                                      ("1", True), ("true", True), ("", True)])
def test_a_switch_reads_the_words_people_write(value, on, monkeypatch):
    from hetplan.env import switch

    monkeypatch.setenv("HETPLAN_NATIVE_KERNELS", value)
    assert switch("HETPLAN_NATIVE_KERNELS", True) is on
