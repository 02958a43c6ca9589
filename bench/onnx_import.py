"""Import and compile an ONNX export of a ~1B-parameter llama-style model (external data).

Builds the graph with ``onnx.helper`` the way a decoder-with-past export looks (RMSNorm
decomposed into Pow/ReduceMean/Sqrt, rotary embeddings from position ids, grouped-query
attention with past key/values and a causal mask, SwiGLU MLP) and writes seeded random weights
as one external-data file in chunks, so no full copy of the weights is ever held in memory. Then,
each in a fresh process, it measures side by side:

- ``hetplan``: ``spec_from_onnx`` + ``compile_plan`` (the MILP), wall time and peak RSS;
- ``onnx.load``: reading the same model with its weights (what a loader that materialises
  initializers costs), wall time and peak RSS.

Usage: python bench/onnx_import.py [--dir DIR] [--layers 22] [--dtype fp32] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TINYLLAMA = dict(vocab=32000, hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4)
"""TinyLlama-1.1B's shape: 1.10e9 parameters."""


class GraphBuilder:
    """Nodes, initializers and the external-data file of one graph, named like an exporter."""

    def __init__(self, weights_path: Path, dtype):
        from onnx import TensorProto
        self.nodes, self.inits, self.dtype = [], [], dtype
        self.elem = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16}[dtype]
        self.file = open(weights_path, "wb")
        self.location = weights_path.name
        self.rng = np.random.default_rng(0)
        self.count = 0

    def node(self, op, inputs, name, n_out=1, **attrs):
        from onnx import helper
        outs = [f"{name}_output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, name, value, dtype=np.int64):
        from onnx import numpy_helper
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def weight(self, name, shape, std=0.02, offset=0.0, chunk=1 << 24):
        """A [shape] weight of random values written to the external file in chunks."""
        from onnx import TensorProto
        start = self.file.tell()
        n = int(np.prod(shape))
        for lo in range(0, n, chunk):
            vals = self.rng.standard_normal(min(chunk, n - lo), dtype=np.float32) * std + offset
            self.file.write(vals.astype(self.dtype).tobytes())
        t = TensorProto(name=name, data_type=self.elem, dims=list(shape), data_location=TensorProto.EXTERNAL)
        for k, v in (("location", self.location), ("offset", str(start)), ("length", str(self.file.tell() - start))):
            entry = t.external_data.add()
            entry.key, entry.value = k, v
        self.inits.append(t)
        pad = -self.file.tell() % 4096
        self.file.write(b"\0" * pad)
        return name


def _rms_norm(g, x, weight_name, hidden, prefix):
    sq = g.node("Pow", [x, "two"], f"{prefix}/Pow")
    mean = g.node("ReduceMean", [sq], f"{prefix}/ReduceMean", axes=[-1], keepdims=1)
    var = g.node("Add", [mean, "eps"], f"{prefix}/Add")
    inv = g.node("Reciprocal", [g.node("Sqrt", [var], f"{prefix}/Sqrt")], f"{prefix}/Reciprocal")
    return g.node("Mul", [g.weight(weight_name, [hidden], 0.1, 1.0), g.node("Mul", [x, inv], f"{prefix}/Mul")],
                  f"{prefix}/Mul_1")


def _rotate(g, t, cos, sin, half, prefix):
    x1 = g.node("Slice", [t, "zero", "half", "axis3"], f"{prefix}/Slice")
    x2 = g.node("Slice", [t, "half", "big", "axis3"], f"{prefix}/Slice_1")
    rot = g.node("Concat", [g.node("Neg", [x2], f"{prefix}/Neg"), x1], f"{prefix}/Concat", axis=-1)
    return g.node("Add", [g.node("Mul", [t, cos], f"{prefix}/Mul"), g.node("Mul", [rot, sin], f"{prefix}/Mul_1")],
                  f"{prefix}/Add")


def build(directory: Path, cfg: dict, dtype=np.float32) -> Path:
    """Write ``model.onnx`` + ``model.weights`` for ``cfg`` into ``directory``; return the .onnx."""
    import onnx
    from onnx import TensorProto, helper
    d, f, L = cfg["hidden"], cfg["intermediate"], cfg["layers"]
    h, kvh = cfg["heads"], cfg["kv_heads"]
    hd = d // h
    g = GraphBuilder(directory / "model.weights", dtype)
    fdt = dtype
    g.const("two", 2.0, fdt), g.const("eps", 1e-5, fdt), g.const("scale", hd ** -0.5, fdt)
    g.const("neg_big", -1e9, fdt), g.const("one_f", 1.0, fdt)
    g.const("zero", [0]), g.const("half", [hd // 2]), g.const("big", [1 << 30])
    g.const("axis3", [3]), g.const("ax01", [0, 1]), g.const("ax1", [1]), g.const("ax2", [2])
    g.const("q_shape", [0, 0, h, hd]), g.const("kv_shape", [0, 0, kvh, hd]), g.const("rep", [1, 1, h // kvh, 1, 1])
    g.const("merge_heads", [0, h, -1, hd]), g.const("out_shape", [0, 0, d]), g.const("idx1", 1)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    g.const("inv_freq", inv_freq.reshape(1, -1), fdt)
    # Prologue: embedding, rotary tables [B, 1, S, hd], causal mask [1, 1, S, T].
    x = g.node("Gather", [g.weight("model.embed_tokens.weight", [cfg["vocab"], d]), "input_ids"],
               "/model/embed_tokens/Gather")
    pos = g.node("Unsqueeze", [g.node("Cast", ["position_ids"], "/model/Cast", to=g.elem), "ax2"], "/model/Unsqueeze")
    freqs = g.node("MatMul", [pos, "inv_freq"], "/model/rotary_emb/MatMul")
    emb = g.node("Concat", [freqs, freqs], "/model/rotary_emb/Concat", axis=-1)
    cos = g.node("Unsqueeze", [g.node("Cos", [emb], "/model/rotary_emb/Cos"), "ax1"], "/model/rotary_emb/Unsqueeze")
    sin = g.node("Unsqueeze", [g.node("Sin", [emb], "/model/rotary_emb/Sin"), "ax1"], "/model/rotary_emb/Unsqueeze_1")
    s_len = g.node("Gather", [g.node("Shape", ["input_ids"], "/model/Shape"), "idx1"], "/model/Gather")
    t_len = g.node("Gather", [g.node("Shape", ["attention_mask"], "/model/Shape_1"), "idx1"], "/model/Gather_1")
    past_len = g.node("Sub", [t_len, s_len], "/model/Sub")
    st = g.node("Concat", [g.node("Unsqueeze", [s_len, "zero"], "/model/Unsqueeze_1"),
                           g.node("Unsqueeze", [t_len, "zero"], "/model/Unsqueeze_2")], "/model/Concat", axis=0)
    ones = g.node("ConstantOfShape", [st], "/model/ConstantOfShape",
                  value=helper.make_tensor("v", g.elem, [1], [1.0]))
    allowed = g.node("Trilu", [ones, past_len], "/model/Trilu", upper=0)
    blocked = g.node("Sub", ["one_f", allowed], "/model/Sub_1")
    mask = g.node("Unsqueeze", [g.node("Mul", [blocked, "neg_big"], "/model/Mul"), "ax01"], "/model/Unsqueeze_3")
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"])]
    outputs = []
    for l in range(L):
        p, w = f"/model/layers.{l}", f"model.layers.{l}"
        xn = _rms_norm(g, x, f"{w}.input_layernorm.weight", d, f"{p}/input_layernorm")
        heads = {}
        for name, width, shape in (("q", h * hd, "q_shape"), ("k", kvh * hd, "kv_shape"), ("v", kvh * hd, "kv_shape")):
            proj = g.node("MatMul", [xn, g.weight(f"{w}.self_attn.{name}_proj.weight", [d, width])],
                          f"{p}/self_attn/{name}_proj/MatMul")
            heads[name] = g.node("Transpose", [g.node("Reshape", [proj, shape], f"{p}/self_attn/Reshape_{name}")],
                                 f"{p}/self_attn/Transpose_{name}", perm=[0, 2, 1, 3])
        q = _rotate(g, heads["q"], cos, sin, hd // 2, f"{p}/self_attn/rotary_q")
        k = _rotate(g, heads["k"], cos, sin, hd // 2, f"{p}/self_attn/rotary_k")
        kv = {}
        for name, new in (("key", k), ("value", heads["v"])):
            past = f"past_key_values.{l}.{name}"
            inputs.append(helper.make_tensor_value_info(past, g.elem, ["batch", kvh, "past", hd]))
            kv[name] = g.node("Concat", [past, new], f"{p}/self_attn/Concat_{name}", axis=2)
            outputs.append(helper.make_tensor_value_info(kv[name], g.elem, ["batch", kvh, "total", hd]))
        full = {}
        for name in ("key", "value"):
            e = g.node("Expand", [g.node("Unsqueeze", [kv[name], "ax2"], f"{p}/self_attn/Unsqueeze_{name}"), "rep"],
                       f"{p}/self_attn/Expand_{name}")
            full[name] = g.node("Reshape", [e, "merge_heads"], f"{p}/self_attn/Reshape_{name}_full")
        kt = g.node("Transpose", [full["key"]], f"{p}/self_attn/Transpose_kt", perm=[0, 1, 3, 2])
        scores = g.node("Mul", [g.node("MatMul", [q, kt], f"{p}/self_attn/MatMul"), "scale"], f"{p}/self_attn/Mul")
        probs = g.node("Softmax", [g.node("Add", [scores, mask], f"{p}/self_attn/Add")], f"{p}/self_attn/Softmax",
                       axis=-1)
        ctx = g.node("Transpose", [g.node("MatMul", [probs, full["value"]], f"{p}/self_attn/MatMul_1")],
                     f"{p}/self_attn/Transpose_ctx", perm=[0, 2, 1, 3])
        o = g.node("MatMul", [g.node("Reshape", [ctx, "out_shape"], f"{p}/self_attn/Reshape_out"),
                              g.weight(f"{w}.self_attn.o_proj.weight", [h * hd, d])], f"{p}/self_attn/o_proj/MatMul")
        x = g.node("Add", [x, o], f"{p}/Add")
        xn = _rms_norm(g, x, f"{w}.post_attention_layernorm.weight", d, f"{p}/post_attention_layernorm")
        gate = g.node("MatMul", [xn, g.weight(f"{w}.mlp.gate_proj.weight", [d, f])], f"{p}/mlp/gate_proj/MatMul")
        up = g.node("MatMul", [xn, g.weight(f"{w}.mlp.up_proj.weight", [d, f])], f"{p}/mlp/up_proj/MatMul")
        act = g.node("Mul", [gate, g.node("Sigmoid", [gate], f"{p}/mlp/act_fn/Sigmoid")], f"{p}/mlp/act_fn/Mul")
        down = g.node("MatMul", [g.node("Mul", [act, up], f"{p}/mlp/Mul"),
                                 g.weight(f"{w}.mlp.down_proj.weight", [f, d])], f"{p}/mlp/down_proj/MatMul")
        x = g.node("Add", [x, down], f"{p}/Add_1")
    xn = _rms_norm(g, x, "model.norm.weight", d, "/model/norm")
    logits = g.node("MatMul", [xn, g.weight("lm_head.weight", [d, cfg["vocab"]])], "/lm_head/MatMul")
    outputs.insert(0, helper.make_tensor_value_info(logits, TensorProto.FLOAT if fdt == np.float32 else g.elem,
                                                    ["batch", "seq", cfg["vocab"]]))
    g.file.close()
    graph = helper.make_graph(g.nodes, "llama", inputs, outputs, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = directory / "model.onnx"
    onnx.save_model(model, str(path))
    return path


CHILD_HETPLAN = """
import json, resource, sys, time
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.frontends.onnx.importer import spec_from_onnx
t0 = time.perf_counter()
spec = spec_from_onnx(sys.argv[1])
out = {"import_s": time.perf_counter() - t0, "params": spec.total_params()}
for case, gpu_mem in (("fits", None), ("offload", "1.5GiB")):
    t1 = time.perf_counter()
    plan, solve_s = compile_plan(CompileRequest(model=sys.argv[1], hw="rtx3090-128g", prompt_len=512,
                                                gen_len=128, gpu_mem=gpu_mem))
    out[case] = {"compile_s": time.perf_counter() - t1, "solve_s": solve_s, "status": plan.solver["status"],
                 "blocks": len(plan.placement), "placement": sorted({p["weights"] for p in plan.placement})}
    if case == "fits":
        out["import_compile_s"] = time.perf_counter() - t0
out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(out))
"""

CHILD_ONNX_LOAD = """
import json, resource, sys, time
import onnx
t0 = time.perf_counter()
m = onnx.load(sys.argv[1])
t1 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _child(code: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="Where to write the model (default: a temporary directory).")
    ap.add_argument("--layers", type=int, default=TINYLLAMA["layers"])
    ap.add_argument("--dtype", choices=("fp32", "fp16"), default="fp32")
    ap.add_argument("--keep", action="store_true", help="Keep the generated model.")
    args = ap.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="hetplan-onnx-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    cfg = {**TINYLLAMA, "layers": args.layers}
    t0 = time.perf_counter()
    path = build(directory, cfg, np.float32 if args.dtype == "fp32" else np.float16)
    weights_bytes = (directory / "model.weights").stat().st_size
    print(f"built {path} ({path.stat().st_size / 2**20:.1f} MiB graph, {weights_bytes / 2**30:.2f} GiB external "
          f"data) in {time.perf_counter() - t0:.1f} s")
    try:
        hp = _child(CHILD_HETPLAN, path)
        ol = _child(CHILD_ONNX_LOAD, path)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(directory)
    gib = 2**30
    fits, off = hp["fits"], hp["offload"]
    print(f"model: {hp['params'] / 1e9:.2f} B parameters, {fits['blocks']} blocks, {args.dtype}, "
          f"weights {weights_bytes / gib:.2f} GiB; node rtx3090-128g, prompt 512, gen 128")
    print(f"hetplan import (spec_from_onnx)          {hp['import_s']:8.2f} s")
    print(f"hetplan import + compile, model fits     {hp['import_compile_s']:8.2f} s   (block graph + solve "
          f"{fits['compile_s']:.2f} s of which MILP {fits['solve_s']:.2f} s, {fits['status']}, "
          f"{'/'.join(fits['placement'])})")
    print(f"compile again, --gpu-mem 1.5GiB          {off['compile_s']:8.2f} s   (MILP {off['solve_s']:.2f} s, "
          f"{off['status']}, {'/'.join(off['placement'])})")
    print(f"hetplan peak RSS                         {hp['peak_rss_bytes'] / gib:8.3f} GiB = "
          f"{hp['peak_rss_bytes'] / weights_bytes:.3f} x the weights")
    print(f"onnx.load with weights                   {ol['load_s']:8.2f} s   peak RSS "
          f"{ol['peak_rss_bytes'] / gib:.3f} GiB = {ol['peak_rss_bytes'] / weights_bytes:.3f} x the weights")
    print(f"peak RSS ratio onnx.load / hetplan       {ol['peak_rss_bytes'] / hp['peak_rss_bytes']:8.1f} x")


if __name__ == "__main__":
    main()
