"""``--strategy from-ktransformers:FILE``: a kTransformers optimize-rule YAML -> the placement it
means, executed as the ``ktransformers`` baseline executes kTransformers' placements.

Follows kTransformers' ``gen_optimize_config`` (ktransformers/optimize/optimize.py): for each
module the first rule whose ``match.name`` regex is found in its name (and whose ``match.class``
fits it) applies; a module no rule matches stays on the GPU. Read per block: the layer's routed
experts (``mlp.experts``, Mixtral's ``block_sparse_moe.experts``) with ``generate_device: cpu``
stay in host memory and run on the CPU in both phases (as the baseline models kTransformers);
the embedding, attention, dense MLP and head run where their rule's ``generate_device`` says.
Class matches are judged by name (``torch.nn.Linear`` fits the head only among these modules).
KV caches live with their attention.
"""

from __future__ import annotations

import re

import yaml

from hetplan.errors import HetplanError
from hetplan.files import BoundedLoader
from hetplan.problem import Problem


def parse(text: str) -> list:
    try:
        rules = yaml.load(text, Loader=BoundedLoader)
    except yaml.YAMLError as e:
        raise HetplanError(f"--strategy from-ktransformers: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(rules, list) or not all(isinstance(r, dict) and isinstance(r.get("match"), dict)
                                              and isinstance(r.get("replace"), dict) for r in rules):
        raise HetplanError("--strategy from-ktransformers: expected a list of rules, each with 'match' and 'replace'")
    for i, r in enumerate(rules):
        name = r["match"].get("name")
        if name is None and "class" not in r["match"]:
            raise HetplanError(f"--strategy from-ktransformers: rule {i + 1}: match needs a name or a class")
        if name is not None:
            try:
                re.compile(str(name))
            except re.error as e:
                raise HetplanError(f"--strategy from-ktransformers: rule {i + 1}: bad name regex {name!r} ({e})") from None
    return rules


def device(rules: list, module: str, linear: bool = False) -> str:
    """``cpu`` or ``gpu``: the decode device the first matching rule gives ``module``."""
    for r in rules:
        m = r["match"]
        if "name" in m and re.search(str(m["name"]), module) is None:
            continue
        if "class" in m and (str(m["class"]).endswith(".Linear") != linear or "name" not in m):
            continue
        dev = str((r["replace"].get("kwargs") or {}).get("generate_device", "cuda"))
        return "cpu" if dev == "cpu" else "gpu"
    return "gpu"


def decide(problem: Problem, text: str):
    from hetplan.solvers import baselines

    rules = parse(text)
    spec = problem.model
    if not problem.has_gpu:
        return baselines.all_cpu(problem)
    experts_at = "block_sparse_moe.experts" if spec.arch == "mixtral" else "mlp.experts"
    on_gpu, experts = set(), {}
    for b in problem.blocks:
        if b.kind == "embed":
            where = device(rules, "model.embed_tokens")
        elif b.kind == "head":
            where = device(rules, "lm_head", linear=True)
        elif b.kind == "attn":
            where = device(rules, f"model.layers.{b.layer}.self_attn")
        else:
            where = device(rules, f"model.layers.{b.layer}.mlp")
            if b.kind == "moe" and where == "gpu" and device(rules, f"model.layers.{b.layer}.{experts_at}") == "cpu":
                experts[b.name] = 0
        if where == "gpu":
            on_gpu.add(b.name)
    kv = {b.name: "gpu" if b.name in on_gpu else "cpu" for b in problem.blocks if b.kind == "attn"}
    return baselines._llama_cpp(problem, on_gpu, kv, experts, offload=False)
