"""``--strategy from-llama.cpp:ARGS``: llama-server / llama-cli arguments -> the placement they
mean, executed as the ``ngl`` baseline executes llama.cpp's placements.

Follows llama.cpp's rules (common/arg.cpp, src/llama-model.cpp, master of late 2026): of the
``n_layers + 1`` layer slots (the repeating layers, then the output layer) the last ``-ngl N``
are on the GPU, the token embeddings always in host memory; ``-ot PATTERN=BUFT[,...]`` moves each
tensor whose name the pattern finds (``std::regex_search``) to that buffer type, the first
matching override winning, in the order given; ``--cpu-moe`` is ``-ot \\.ffn_(up|down|gate)_exps=CPU``
and ``--n-cpu-moe N`` that pattern for layers ``0..N-1``; a layer's KV cache lives with the
layer (on the GPU for the last ``-ngl`` layers) unless ``-nkvo``. A block is on the GPU when all
its tensors are; a MoE block whose routed-expert tensors alone are in host memory keeps the rest
on the GPU with no expert resident there.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from hetplan.errors import HetplanError
from hetplan.export.names import gguf_block, gguf_tensor_names, is_expert_tensor
from hetplan.problem import Problem

CPU_MOE = r"\.ffn_(up|down|gate)_exps"
"""The pattern ``--cpu-moe`` adds (``--n-cpu-moe N``: ``blk\\.{i}\\.ffn_(up|down|gate)_exps``)."""
GPU_BUFTS = re.compile(r"^(CUDA|ROCm|Vulkan|Metal|SYCL)\d*$")
IGNORED = {"-c": 1, "--ctx-size": 1, "-b": 1, "--batch-size": 1, "-ub": 1, "--ubatch-size": 1, "-t": 1,
           "--threads": 1, "-tb": 1, "--threads-batch": 1, "-np": 1, "--parallel": 1, "-m": 1, "--model": 1,
           "-fa": 1, "--flash-attn": 1}
"""Options that size the run (context, batches, threads) or name the file: read, not placement."""


@dataclass
class LlamaArgs:
    ngl: int | None = None
    """``-ngl``; None: ``auto`` (llama.cpp's ``--fit``), the default."""
    overrides: list = field(default_factory=list)
    """(pattern, on_gpu) in the order llama.cpp tries them."""
    nkvo: bool = False
    op_offload: bool = True


def parse(text: str) -> LlamaArgs:
    """Parse llama.cpp arguments; one line naming the option for anything it cannot read."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise HetplanError(f"--strategy from-llama.cpp: cannot split the arguments ({e}); quote them as a shell would")
    args, i = LlamaArgs(), 0

    def value(flag):
        if i + 1 >= len(words):
            raise HetplanError(f"--strategy from-llama.cpp: {flag} needs a value")
        return words[i + 1]

    while i < len(words):
        w = words[i]
        flag, eq, inline = w.partition("=") if w.startswith("--") else (w, "", "")
        if eq:
            words[i:i + 1] = [flag, inline]
            w = flag
        if w in ("-ngl", "--gpu-layers", "--n-gpu-layers"):
            v = value(w)
            args.ngl = None if v == "auto" else 10 ** 9 if v == "all" else _count(w, v)
            i += 2
        elif w in ("-ot", "--override-tensor"):
            args.overrides += _overrides(value(w))
            i += 2
        elif w in ("-cmoe", "--cpu-moe"):
            args.overrides.append((CPU_MOE, False))
            i += 1
        elif w in ("-ncmoe", "--n-cpu-moe"):
            args.overrides += [(rf"blk\.{l}\.ffn_(up|down|gate)_exps", False) for l in range(_count(w, value(w)))]
            i += 2
        elif w in ("-nkvo", "--no-kv-offload"):
            args.nkvo, i = True, i + 1
        elif w == "--no-op-offload":
            args.op_offload, i = False, i + 1
        elif w in IGNORED:
            value(w)
            i += 1 + IGNORED[w]
        else:
            raise HetplanError(f"--strategy from-llama.cpp: option {w!r} is not one hetplan reads (it reads -ngl, -ot, "
                               f"--cpu-moe, --n-cpu-moe, -nkvo, --no-op-offload, -c, -b, -ub, -t, -np, -m); drop it")
    return args


def _count(flag: str, v: str) -> int:
    if not v.isdigit():
        raise HetplanError(f"--strategy from-llama.cpp: {flag} {v!r}: expected a non-negative integer")
    return int(v)


def _overrides(value: str) -> list:
    out = []
    for item in value.split(","):
        pattern, eq, buft = item.rpartition("=")
        if not eq or not pattern:
            raise HetplanError(f"--strategy from-llama.cpp: -ot {item!r}: expected PATTERN=BUFFER_TYPE, e.g. "
                               f"'blk\\.[0-9]\\.ffn_.*=CPU'")
        if buft != "CPU" and not GPU_BUFTS.match(buft):
            raise HetplanError(f"--strategy from-llama.cpp: -ot {item!r}: unknown buffer type {buft!r}; use CPU or "
                               f"CUDA0")
        try:
            re.compile(pattern)
        except re.error as e:
            raise HetplanError(f"--strategy from-llama.cpp: -ot {item!r}: bad regular expression ({e})") from None
        out.append((pattern, buft != "CPU"))
    return out


def first_gpu_layer(n_layers: int, ngl: int) -> int:
    """The first layer slot ``-ngl ngl`` puts on the GPU (``n_layers``: the output layer only)."""
    return n_layers + 1 - min(ngl, n_layers + 1)


def tensor_on_gpu(names: list, n_layers: int, args: LlamaArgs) -> dict:
    """GGUF tensor name -> on the GPU? (``args.ngl`` must be set)."""
    first = first_gpu_layer(n_layers, args.ngl)
    out = {}
    for name in names:
        hit = next((gpu for pattern, gpu in args.overrides if re.search(pattern, name)), None)
        if hit is not None:
            out[name] = hit
        elif name == "token_embd.weight":
            out[name] = False
        elif name.startswith("blk."):
            out[name] = int(name.split(".")[1]) >= first
        else:  # the output layer: the last slot
            out[name] = n_layers >= first
    return out


def decide(problem: Problem, text: str, model_source: str | None = None):
    """The Decision llama.cpp makes of ``text`` on ``problem``'s model."""
    from hetplan.solvers import baselines

    args = parse(text)
    spec = problem.model
    if args.ngl is None:  # -ngl auto: what --fit picks, when nothing else is said
        if args.overrides or args.nkvo:
            raise HetplanError("--strategy from-llama.cpp: give -ngl N with -ot/--n-cpu-moe/-nkvo (hetplan reads "
                               "--fit only for plain -ngl auto)")
        return baselines.ngl(problem, None)
    if not problem.has_gpu:
        return baselines.all_cpu(problem)
    names = gguf_tensor_names(spec, model_source)
    on = tensor_on_gpu(names, spec.n_layers, args)
    blocks: dict = {}
    for name in names:
        b = gguf_block(name, spec)
        if b is not None:
            blocks.setdefault(b, []).append(name)
    on_gpu, experts = set(), {}
    for b in problem.blocks:
        ts = blocks.get(b.name, [])
        rest = [t for t in ts if not is_expert_tensor(t)]
        if ts and all(on[t] for t in ts):
            on_gpu.add(b.name)
        elif b.kind == "moe" and rest and all(on[t] for t in rest) and not any(on[t] for t in ts if is_expert_tensor(t)):
            on_gpu.add(b.name)
            experts[b.name] = 0
    first = first_gpu_layer(spec.n_layers, args.ngl)
    kv = {b.name: "gpu" if b.layer >= first and not args.nkvo else "cpu" for b in problem.blocks if b.kind == "attn"}
    return baselines._llama_cpp(problem, on_gpu, kv, experts, offload=None if args.op_offload else False)
