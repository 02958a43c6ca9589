"""Tiny pipeline plans built in code: a tiny random llama saved with ``save_pretrained``, a node
of four emulated GPUs, and each stage's plan chosen by a named strategy (so a test decides which
stages stream or compute on the CPU), recorded in plan.json as ``hetplan compile`` records it;
and ``lines_of``, a stage process's stderr lines as they come."""

from __future__ import annotations

import dataclasses
import queue
import subprocess
import threading

import torch
import transformers

from hetplan import cost
from hetplan.compiler import CompileRequest, stage_solver
from hetplan.frontends.resolve import load_model
from hetplan.hardware import load_node
from hetplan.pipeline import PipelinePlan, StagePlan, hidden_bytes, stage_problem
from hetplan.pipeline.compile import replicated, with_gpu_budgets
from hetplan.pipeline.plan import micro_batch_count
from hetplan.pipeline.topology import Topology
from hetplan.plan import Plan, load_plan
from hetplan.workload import Workload
from tests.tiny_models import greedy_reference as reference  # noqa: F401  (the pipeline tests' transformers run)

N_LAYERS, VOCAB = 4, 128

NODE = """
name: four-tiny-gpus
gpus:
  - {name: g, memory: 64MiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}
  - {name: g, memory: 64MiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}
  - {name: g, memory: 64MiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}
  - {name: g, memory: 64MiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}
cpu: {name: cpu, cores: 2, memory: 4GiB, mem_bandwidth: 20GB/s, flops: {fp32: 2GFLOPS}}
links: {h2d: 10GB/s, d2h: 10GB/s}
peers: [{between: all, kind: pcie, bandwidth: 10GB/s}]
reserve: {gpu: 1KiB, cpu: 1KiB}
latency: {gpu_task: 1.0e-6, cpu_task: 1.0e-6, link_task: 1.0e-6}
"""


def save_llama(directory, hidden: int = 64, intermediate: int = 96) -> transformers.PreTrainedModel:
    """A 4-layer llama (hidden 64, GQA, vocab 128), weights drawn wide (std 0.2) so that greedy
    choices are far from ties, saved in ``directory``."""
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=N_LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=4096, initializer_range=0.2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def pipeline_plan(model_dir, node_path, cuts: list, strategies: list, wl: Workload, out_path,
                  objective: str = "sum") -> Plan:
    """The plan of ``model_dir`` as a pipeline of one stage per GPU: stage ``k``
    holds layers ``[cuts[k], cuts[k + 1])`` and is planned by ``strategies[k]`` (``all-gpu``,
    ``stream``, ``ngl:N`` ...); ``objective``: ``sum`` (latency) or ``max`` (throughput);
    written to ``out_path`` and read back (schema checked)."""
    spec, hw = load_model(str(model_dir), "fp32"), load_node(str(node_path))
    req = CompileRequest(model=str(model_dir), hw=str(node_path))
    m = micro_batch_count(objective, len(cuts) - 1)   # each stage's KV caches: one per micro-batch in flight
    stages = []
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        name, _, arg = strategies[k].partition(":")
        plan = stage_solver(req, name, int(arg) if arg else None)(stage_problem(spec, hw, wl, k, a, b, m))
        assert plan is not None, f"stage {k} does not fit"
        stages.append(StagePlan(k, a, b, plan))
    links = tuple({"from": s.gpu, "to": t.gpu, "kind": hw.peer(s.gpu, t.gpu).kind,
                   "prefill_s": cost.peer_seconds(hidden_bytes(spec, wl, "prefill"), hw, s.gpu, t.gpu),
                   "decode_s": cost.peer_seconds(hidden_bytes(spec, wl, "decode"), hw, s.gpu, t.gpu)}
                  for s, t in zip(stages, stages[1:]))
    pp = PipelinePlan(tuple(stages), links, wl, objective, model=spec, micro_batches=m)
    return _written(pp, out_path)


def replicated_plan(model_dir, node_path, replicas: int, wl: Workload, out_path, gpu_mem: str | None = None) -> Plan:
    """The throughput plan of ``model_dir`` as ``replicas`` replicas over the node's GPUs, the
    replica count given, everything else chosen by the planner (``compile.replicated``: the
    stages of the best pipeline over the first group of GPUs); ``gpu_mem`` as ``--gpu-mem``
    (each GPU's budget, so that one GPU does not hold the model); written to ``out_path`` and
    read back (schema checked)."""
    spec = load_model(str(model_dir), "fp32")
    hw = with_gpu_budgets(load_node(str(node_path)), gpu_mem)
    req = CompileRequest(model=str(model_dir), hw=str(node_path), objective="throughput")
    pp = replicated(spec, Topology.of(hw), replicas, wl, stage_solver(req, moe_stages=True))
    return _written(pp, out_path)


def _written(pp: PipelinePlan, out_path) -> Plan:
    """``pp`` as hetplan compile writes it (the main part is the first stage's own plan), read back."""
    whole = dataclasses.replace(pp.stages[0].plan, pipeline=pp.to_dict())
    out_path.write_text(whole.to_json())
    return load_plan(out_path)


def tiers(plan: Plan) -> set:
    """What the stages' own plans hold: ``gpu``, ``stream``, ``cpu`` weights of layer blocks."""
    return {p["weights"] for st in plan.pipeline["stages"] for p in st["plan"]["placement"] if p["layer"] is not None}


def lines_of(proc: subprocess.Popen) -> queue.Queue:
    """proc's stderr lines as they come (None at its end)."""
    q = queue.Queue()

    def pump():
        for line in proc.stderr:
            q.put(line)
        q.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return q
