"""The native kernel at another commit against the working tree's: decode GEMVs and decode attention.

    python bench/kernel_ab.py --base HEAD~1 [--rounds 6] [--formats fp32,bf16,q8_0,q4_0]

Both sources (``runtime/kernels/native`` at ``--base``, read with ``git show``, and as it is on
disk) are built as this CPU's runtime builds them (``native.CFLAGS``) under two
module names in a scratch directory, so one process holds both. On the 0.85 B bench model's
decode shapes (``bench/exec_cpu.py``: qkv [3072, 2048], o [2048, 2048], gate_up [11264, 2048],
down [2048, 5632], and the head [32000, 2048] in fp32) each pass multiplies one row of x with
every copy of every weight (about 300 MB of each format, in huge-page memory as the runtime places
weights, so each read comes from DRAM) and reports GB/s of weight bytes; decode attention is
timed over 128 cached tokens (32 query / 8 key-value heads of 64), fp32. The two builds take
turns, first one then the other, in ``--rounds`` rounds, twice: on a quiet machine, and beside a
*neighbour* process that keeps a core busy 2 ms out of every 10 (as another tenant of a shared
host can), which a static split of rows between threads waits out in full. Medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NATIVE = Path(__file__).resolve().parents[1] / "runtime" / "kernels" / "native"
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
          "head": (32000, 2048)}
FORMAT_IDS = {"q8_0": 0, "q4_0": 1, "bf16": 5, "fp32": 7}
NEIGHBOUR = "import time\nwhile True:\n t = time.perf_counter()\n while time.perf_counter() - t < 0.002: pass\n " \
            "time.sleep(0.008)"


def build(tag: str, files: dict, where: Path):
    """Compile ``files`` (name -> text) as module ``qm_<tag>``."""
    from torch.utils import cpp_extension

    from hetplan.runtime.kernels.native import CFLAGS, LDFLAGS

    d = where / tag
    d.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (d / name).write_text(text)
    return cpp_extension.load(name=f"qm_{tag}", sources=[str(d / "qmatmul.cpp")], build_directory=str(d),
                              extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=False)


def sources(base: str | None) -> dict:
    """The native kernel's files at commit ``base`` (None: on disk)."""
    names = [p.name for p in NATIVE.iterdir() if p.suffix in (".h", ".cpp")]
    if base is None:
        return {n: (NATIVE / n).read_text() for n in names}
    root = NATIVE.parents[2]
    rel = NATIVE.relative_to(root).as_posix()
    out = {}
    for n in names:
        res = subprocess.run(["git", "-C", str(root), "show", f"{base}:{rel}/{n}"], capture_output=True, text=True)
        if res.returncode == 0:
            out[n] = res.stdout
    return out


def weight_sets(fmt: str) -> dict:
    """name -> (K, [row arrays of each copy]) for ``fmt``, about 300 MB of each."""
    import torch
    from hetplan.runtime.devices import placed_empty
    from hetplan.runtime.kernels import quant

    out = {}
    for name, (n, k) in SHAPES.items():
        if name == "head" and fmt != "fp32":
            continue
        per = {"fp32": 4, "bf16": 2}.get(fmt, 1)
        copies = max(2, int(300e6 // (n * k * per)))
        sets = []
        for _ in range(copies):
            w = placed_empty((n, k), torch.float32, torch.device("cpu")).normal_()
            if fmt == "fp32":
                sets.append([w])
            elif fmt == "bf16":
                sets.append([w.to(torch.bfloat16)])
            else:
                sets.append([p.clone() for p in quant.split(fmt, quant.quantise(fmt, w), (n, k))])
        out[name] = (k, sets)
    return out


def gemv_pass(mod, fmt: str, sets: dict) -> float:
    """GB/s of weight bytes over one pass through every copy of every weight."""
    import torch

    nbytes, t0 = 0, time.perf_counter()
    for k, copies in sets.values():
        x = torch.randn(1, k)
        for parts in copies:
            mod.matmul(x, FORMAT_IDS[fmt], k, parts, fmt in ("q8_0", "q4_0"))
            nbytes += sum(p.numel() * p.element_size() for p in parts)
    return nbytes / (time.perf_counter() - t0) / 1e9


def attention_us(mod, kv: list) -> float:
    """Microseconds per decode attention over 128 cached tokens (copies cycled)."""
    q, t0 = kv[0][0], time.perf_counter()
    for _, k, v in kv * 8:
        mod.decode_attention(q, k, v, 0.125)
    return (time.perf_counter() - t0) / (len(kv) * 8) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the commit whose native kernel is compared")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--formats", default="fp32,bf16,q8_0,q4_0")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    formats = args.formats.split(",")
    unknown = set(formats) - set(FORMAT_IDS)
    if unknown:
        print(f"unknown formats {sorted(unknown)}: choose from {sorted(FORMAT_IDS)}", file=sys.stderr)
        return 2
    base = sources(args.base)
    if "qmatmul.cpp" not in base:
        print(f"no runtime/kernels/native/qmatmul.cpp at {args.base}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kernel_ab_") as tmp:
        mods = {"base": build("base", base, Path(tmp)), "tree": build("tree", sources(None), Path(tmp))}
        sets = {fmt: weight_sets(fmt) for fmt in formats}
        kv = [(torch.randn(1, 1, 32, 64), torch.randn(1, 128, 8, 64), torch.randn(1, 128, 8, 64)) for _ in range(16)]
        print(f"native kernel at {args.base} (base) and in the working tree (tree), 2 threads; medians of "
              f"{args.rounds} passes each")
        print("| machine | build | " + " | ".join(f"{f} GB/s" for f in formats) + " | attention 128 (us) |")
        print("|---|---|" + "---:|" * (len(formats) + 1))
        for phase in ("quiet", "neighbour"):
            neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if phase == "neighbour" else None
            try:
                res: dict = {}
                for r in range(args.rounds):
                    for tag in (("base", "tree") if r % 2 == 0 else ("tree", "base")):
                        for fmt in formats:
                            res.setdefault((tag, fmt), []).append(gemv_pass(mods[tag], fmt, sets[fmt]))
                        res.setdefault((tag, "attn"), []).append(attention_us(mods[tag], kv))
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            for tag in ("base", "tree"):
                cells = [f"{statistics.median(res[(tag, f)]):.1f}" for f in formats]
                print(f"| {phase} | {tag} | " + " | ".join(cells) + f" | {statistics.median(res[(tag, 'attn')]):.0f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
