"""How far are hetplan's predictions from published runs? Load every bench/published/*.json (one
file per source: llama.cpp llama-bench tables, kTransformers, FlexGen, ...), check each point
strictly, compile it with the strategy that reproduces the tool's placement, and print predicted
against published with the signed error (predicted - published) / published.

    python bench/published_accuracy.py                          # today's constants
    python bench/published_accuracy.py --check                  # only validate the data files
    python bench/published_accuracy.py --only flexgen --json out.json
    python bench/published_accuracy.py --set gpu_mem=0.6 --set gpu_task=5e-6
    python bench/published_accuracy.py --fit gpu_mem=0.5,0.6,0.7,0.85 --fit cpu_mem=0.4,0.55,0.7 \\
        --fit-class consumer_gpu --fit-class desktop_cpu

``--set`` puts a constant into every node.yaml's ``efficiency:`` (gpu_mem, cpu_mem, link, gpu_flops,
cpu_flops) or ``latency:`` (gpu_task, cpu_task, link_task, seconds) key. ``--fit`` grid-searches the
named constants for the least median |error| over the selected points and reports leave-one-out
error: for each point, the constants fitted on the other n-1 predict it (fit_constants()). Every
compile is the ``hetplan compile`` command line (run in this process; ``--python`` runs each in its
own process), so a row
can be reproduced by hand from the node.yaml and config.json it writes (``--keep DIR``).

The point format is in bench/published/README.md. Exit 2 when a file or point is malformed (one
line per problem, naming the file and the point), 1 when no point compiles, else 0 (a point hetplan
cannot compile is a FAILED row with hetplan's reason, left out of the statistics).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "published"
EFFICIENCY_KEYS = ("gpu_mem", "cpu_mem", "link", "gpu_flops", "cpu_flops")  # README, section node.yaml
LATENCY_KEYS = ("gpu_task", "cpu_task", "link_task")
CLASSES = ("consumer_gpu", "datacenter_gpu", "desktop_cpu", "server_cpu")
DTYPES = ("fp32", "fp16", "bf16", "int8", "int4", "q8_0", "q4_k_m", "q4_0")
METRICS = {"decode_tokens_per_s": "tokens/s", "prefill_tokens_per_s": "tokens/s",
           "throughput_tokens_per_s": "tokens/s", "tpot_s": "s", "ttft_s": "s"}
STRATEGY = re.compile(r"^(all-gpu|greedy|stream|cpu-moe|ktransformers|ilp|ngl(:\d+)?|ngl-nkvo(:\d+)?|n-cpu-moe(:\d+)?|flexgen(:\d+)?)$")
UNITS = {"memory": re.compile(r"^\d+(\.\d+)?\s*[KMGT]i?B$"),
         "bandwidth": re.compile(r"^\d+(\.\d+)?\s*[KMGT]i?B/s$"),
         "flops": re.compile(r"^\d+(\.\d+)?\s*[GTP]FLOPS$")}
CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
               "max_position_embeddings", "torch_dtype")
# Stand-in for a CPU (and PCIe link) a source does not publish: only all-gpu points may use it, and
# an all-gpu plan neither computes on the CPU nor copies weights over the link.
PLACEHOLDER_CPU = {"name": "placeholder (not published; unused by all-gpu)", "class": "desktop", "cores": 16,
                   "memory": "64GiB", "mem_bandwidth": "50GB/s", "flops": {"fp32": "1TFLOPS"}}
PLACEHOLDER_LINKS = {"h2d": "25GB/s", "d2h": "25GB/s"}


class Invalid(Exception):
    """A malformed file or point; the message names what is wrong."""


# ---------------------------------------------------------------- loading and validation

def load_points(data_dir: Path = DATA) -> tuple[list[dict], list[str]]:
    """Every point of every file, resolved (defaults, hardware key, merged source), and the list of
    problems found, one line each naming the file and the point."""
    points, problems, seen = [], [], {}
    files = sorted(data_dir.glob("*.json"))
    if not files:
        problems.append(f"{data_dir}: no *.json files")
    for path in files:
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            problems.append(f"{path.name}: not JSON: {e}")
            continue
        doc = {"points": doc} if isinstance(doc, list) else doc
        for i, raw in enumerate(doc.get("points") or []):
            pid = raw.get("id") if isinstance(raw, dict) else None
            try:
                p = resolve(doc, raw, path.name)
                validate(p)
                if p["id"] in seen:
                    raise Invalid(f"duplicate id (also in {seen[p['id']]})")
                seen[p["id"]] = path.name
                points.append(p)
            except Invalid as e:
                problems.append(f"{path.name}: point {pid or f'#{i}'}: {e}")
        if not doc.get("points"):
            problems.append(f"{path.name}: no points")
    return points, problems


def resolve(doc: dict, raw: dict, fname: str) -> dict:
    if not isinstance(raw, dict):
        raise Invalid("a point must be an object")
    p = {**(doc.get("defaults") or {}), **raw, "file": fname}
    p["source"] = {**(doc.get("source") or {}), **(raw.get("source") or {})}
    hw = p.get("hardware")
    if isinstance(hw, str):
        table = doc.get("hardware") or {}
        if hw not in table:
            raise Invalid(f"hardware '{hw}' is not in the file's hardware table")
        p["hardware_id"], p["hardware"] = hw, table[hw]
    return p


def need(d, key: str, where: str):
    if not isinstance(d, dict) or d.get(key) in (None, "", {}):
        raise Invalid(f"missing '{where}{key}'")
    return d[key]


def unit(d: dict, key: str, kind: str, where: str) -> None:
    v = need(d, key, where)
    if not isinstance(v, str) or not UNITS[kind].match(v.strip()):
        raise Invalid(f"'{where}{key}' = {v!r} needs an explicit unit (e.g. "
                      f"{ {'memory': '24GiB', 'bandwidth': '936GB/s', 'flops': '82TFLOPS'}[kind]})")


def check_device(d, where: str, cpu: bool) -> None:
    if need(d, "class", where) not in CLASSES or not (need(d, "name", where) and need(d, "spec_source", where)):
        raise Invalid(f"'{where}class' must be one of {CLASSES}")
    unit(d, "memory", "memory", where)
    unit(d, "mem_bandwidth", "bandwidth", where)
    flops = need(d, "flops", where)
    for k in flops:
        unit(flops, k, "flops", f"{where}flops.")
    if cpu:
        if not isinstance(d.get("cores"), int) or d["cores"] <= 0:
            raise Invalid(f"'{where}cores' must be a positive integer")
        need(d, "mem_bandwidth_basis", where)
        need(d, "flops_basis", where)


def latency_bound(p: dict, part: dict) -> bool:
    """An unpublished CPU or link whose rates do not matter: llama-bench ``-nkvo`` ``tg N`` from
    an empty context (attention over at most N cached tokens on the CPU, copies of a few KB per
    layer), marked ``latency_bound`` and explained in the point's ``cpu_note``. The placeholder
    stands in; the fixed per-task costs, which are what the point measures, are the model's own."""
    return (part.get("latency_bound") is True and bool(p.get("cpu_note")) and p["strategy"].startswith("ngl-nkvo")
            and p["workload"]["prompt_len"] == 1 and p["workload"]["gen_len"] <= 128)


def validate(p: dict) -> None:
    need(p, "id", "")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", p["id"]):
        raise Invalid("'id' must be a lowercase slug")
    src = need(p, "source", "")
    if not (src.get("url") or (src.get("repo") and src.get("ref"))):
        raise Invalid("'source' needs 'url' or 'repo' + 'ref'")
    need(src, "quote", "source.")
    model = need(p, "model", "")
    if isinstance(model, dict):
        for k in CONFIG_KEYS:
            need(model, k, "model.")
        if not (model.get("intermediate_size") or model.get("ffn_dim")):
            raise Invalid("missing 'model.intermediate_size'")
    elif not isinstance(model, str):
        raise Invalid("'model' must be a preset name or a config dict")
    for k in ("weight_dtype", "kv_dtype"):
        if (k == "weight_dtype" or k in p) and p.get(k) not in DTYPES:
            raise Invalid(f"'{k}' must be one of {DTYPES}")
    if need(p, "device_class", "") not in CLASSES:
        raise Invalid(f"'device_class' must be one of {CLASSES}")
    need(need(p, "tool", ""), "name", "tool.")
    need(p, "setting", "")
    strategy = need(p, "strategy", "")
    if not STRATEGY.match(strategy):
        raise Invalid(f"unknown strategy {strategy!r}")
    hw = need(p, "hardware", "")
    if not isinstance(hw, dict):
        raise Invalid("'hardware' must be a key of the file's hardware table or a dict")
    gpu = hw.get("gpu")
    if gpu:
        check_device(gpu, "hardware.gpu.", cpu=False)
    for part in ("cpu", "links") if gpu else ("cpu",):
        d = need(hw, part, "hardware.")
        if not isinstance(d, dict):
            raise Invalid(f"'hardware.{part}' must be an object")
        if d.get("published") is False:
            if not (gpu and (strategy == "all-gpu" or latency_bound(p, d))):
                raise Invalid(f"'hardware.{part}' is unpublished: only an all-gpu point on a GPU may leave it out "
                              "(or an ngl-nkvo decode from an empty context, 'latency_bound': true, with a 'cpu_note')")
            need(d, "note", f"hardware.{part}.")
        elif part == "cpu":
            check_device(d, "hardware.cpu.", cpu=True)
        else:
            for k in ("h2d", "d2h") if "d2h" in d else ("h2d",):
                unit(d, k, "bandwidth", "hardware.links.")
            for k in ("pcie", "basis"):
                need(d, k, "hardware.links.")
    if hw.get("reserve") is not None:
        unit(hw["reserve"], "gpu", "memory", "hardware.reserve.")
        need(hw["reserve"], "basis", "hardware.reserve.")
    wl = need(p, "workload", "")
    for k in ("batch", "prompt_len", "gen_len"):
        if not isinstance(wl.get(k), int) or wl[k] < 1:
            raise Invalid(f"'workload.{k}' must be a positive integer")
    metric = need(p, "metric", "")
    if metric not in METRICS:
        raise Invalid(f"'metric' must be one of {sorted(METRICS)}")
    if not isinstance(p.get("value"), (int, float)) or p["value"] <= 0:
        raise Invalid("'value' must be a positive number")
    if need(p, "unit", "") != METRICS[metric]:
        raise Invalid(f"'unit' of {metric} must be {METRICS[metric]!r}, got {p['unit']!r}")


# ---------------------------------------------------------------- compiling

def node(p: dict, overrides: dict) -> dict:
    """The node.yaml mapping (written as JSON, which YAML reads) for a point."""
    hw, out = p["hardware"], {"name": p.get("hardware_id", p["id"])}
    pick = ("name", "cores", "memory", "mem_bandwidth", "flops")
    if hw.get("gpu"):
        out["gpus"] = [{k: hw["gpu"][k] for k in pick if k in hw["gpu"]} | {"class": node_class(hw["gpu"])}]
    cpu = hw["cpu"]
    out["cpu"] = PLACEHOLDER_CPU if cpu.get("published") is False else \
        {k: cpu[k] for k in pick} | {"class": node_class(cpu)}
    if hw.get("gpu"):
        links = hw["links"]
        out["links"] = PLACEHOLDER_LINKS if links.get("published") is False else \
            {"h2d": links["h2d"], "d2h": links.get("d2h", links["h2d"])}
    if hw.get("reserve"):
        out["reserve"] = {"gpu": hw["reserve"]["gpu"]}
    for key, names in (("efficiency", EFFICIENCY_KEYS), ("latency", LATENCY_KEYS)):
        if any(k in overrides for k in names):
            out[key] = {k: v for k, v in overrides.items() if k in names}
    return out


def node_class(device: dict) -> str:
    """A point's device class (``consumer_gpu``) as node.yaml's ``class`` key spells it (``consumer``)."""
    return device["class"].rsplit("_", 1)[0]


def compile_cmd(p: dict, work: Path, overrides: dict) -> list[str]:
    work.mkdir(parents=True, exist_ok=True)
    # JSON is YAML, except that YAML 1.1 (PyYAML) reads 5e-06 as a string: write it 5.0e-06.
    text = re.sub(r"(?<![\d.])(-?\d+)([eE][-+]\d+)", r"\1.0\2", json.dumps(node(p, overrides), indent=1))
    (work / "node.yaml").write_text(text + "\n")
    model = p["model"]
    if isinstance(model, dict):
        (work / "config.json").write_text(json.dumps(model, indent=1) + "\n")
        model = str(work / "config.json")
    wl = p["workload"]
    cmd = ["compile", model, "--hw", str(work / "node.yaml"), "--strategy", p["strategy"],
           "--weight-dtype", p["weight_dtype"], "--batch", str(wl["batch"]),
           "--prompt-len", str(wl["prompt_len"]), "--gen-len", str(wl["gen_len"]),
           "--json", "-o", str(work / "plan.json")]
    if p.get("kv_dtype"):
        cmd[6:6] = ["--kv-dtype", p["kv_dtype"]]
    return cmd


class Runner:
    """Compiles points one at a time through the ``hetplan compile`` command line (in this process
    by default, or with ``python -m hetplan`` when ``python`` is given); caches by (point, constants)."""

    def __init__(self, python: str | None, keep: Path | None = None, verbose: bool = False):
        self.python, self.keep, self.verbose, self.cache = python, keep, verbose, {}
        self.tmp = Path(tempfile.mkdtemp(prefix="hetplan-published-"))

    def _run(self, args: list[str]) -> tuple[int, str, str]:
        if self.python:
            res = subprocess.run([self.python, "-m", "hetplan", *args], capture_output=True, text=True, timeout=600)
            return res.returncode, res.stdout, res.stderr
        from hetplan.cli import main as hetplan_main  # the same command line, without a process start
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = hetplan_main(args)
        return rc, out.getvalue(), err.getvalue()

    def predict(self, p: dict, overrides: dict) -> tuple[float | None, str]:
        key = (p["id"], tuple(sorted(overrides.items())))
        if key not in self.cache:
            work = (self.keep or self.tmp) / p["id"]
            args = compile_cmd(p, work, overrides)
            if self.verbose:
                print("$ hetplan " + " ".join(args), file=sys.stderr, flush=True)
            rc, out, err = self._run(args)
            if rc:
                lines = (err or out).strip().splitlines() or [f"exit {rc}"]
                self.cache[key] = (None, lines[-1].removeprefix("hetplan: error: "))
            else:
                self.cache[key] = (float(json.loads(out)["predicted"][p["metric"]]), "")
        return self.cache[key]


def rel_err(pred: float | None, pub: float) -> float | None:
    """Signed relative error (predicted - published) / published; None when the compile failed."""
    return None if pred is None else (pred - pub) / pub


# ---------------------------------------------------------------- fitting

def fit_constants(points: list[dict], grids: dict[str, list[float]], runner: Runner,
                  base: dict | None = None) -> dict:
    """Grid search: the combination of constants (one value from each grid) with the least median
    |error| over ``points``, and leave-one-out: for each point, the combination fitted on the other
    n-1 points predicts it. Every (point, combination) is compiled once; a point no combination
    compiles is left out, a compile that fails under one combination counts as an infinite error."""
    names, base = list(grids), dict(base or {})
    combos = list(itertools.product(*(grids[n] for n in names)))
    errs = {c: [rel_err(runner.predict(p, {**base, **dict(zip(names, c))})[0], p["value"]) for p in points]
            for c in combos}
    use = [i for i in range(len(points)) if any(errs[c][i] is not None for c in combos)]

    def score(c, skip=None):
        e = [float("inf") if errs[c][i] is None else abs(errs[c][i]) for i in use if i != skip]
        return statistics.median(e) if e else float("inf")

    best = min(combos, key=score)
    held = []
    for i, p in enumerate(points):
        c = min(combos, key=lambda c: score(c, skip=i))
        held.append({"id": p["id"], "constants": dict(zip(names, c)), "error": errs[c][i]})
    ok = [abs(h["error"]) for h in held if h["error"] is not None]
    return {"constants": dict(zip(names, best)), "median_abs_error": score(best),
            "max_abs_error": max((abs(x) for x in errs[best] if x is not None), default=None),
            "loo_median_abs_error": statistics.median(ok) if ok else None,
            "loo_max_abs_error": max(ok) if ok else None, "loo": held, "combinations": len(combos),
            "points_used": len(use)}


# ---------------------------------------------------------------- reporting

def short_model(p: dict) -> str:
    m = p["model"]
    name = m if isinstance(m, str) else m.get("_name_or_path", m["model_type"]).split("/")[-1] + "*"
    return f"{name} {p['weight_dtype']}"


def short_hw(p: dict) -> str:
    hw = p["hardware"]
    gpu = (hw.get("gpu") or {}).get("name", "").replace("NVIDIA ", "").replace("GeForce ", "").replace("Tesla ", "")
    cpu = hw["cpu"].get("name", "?").split(" (")[0] if hw["cpu"].get("published") is not False else "?"
    cpu = cpu.replace("Intel ", "").replace("Core ", "").replace("Xeon Gold ", "")
    return f"{gpu} + {cpu}" if gpu else cpu


def table(rows: list[dict]) -> str:
    head = ("id", "model", "hardware", "setting", "metric", "published", "predicted", "error")
    body = [(r["id"], short_model(r["point"]), short_hw(r["point"]),
             f"{r['point']['strategy']} b{r['point']['workload']['batch']} p{r['point']['workload']['prompt_len']}"
             f" g{r['point']['workload']['gen_len']}", r["point"]["metric"].replace("_tokens_per_s", " tok/s"),
             f"{r['point']['value']:.4g}", "-" if r["predicted"] is None else f"{r['predicted']:.4g}",
             "FAILED" if r["error"] is None else f"{100 * r['error']:+.1f}%") for r in rows]
    w = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda row: "  ".join(str(x).ljust(n) if i < 5 else str(x).rjust(n) for i, (x, n) in enumerate(zip(row, w)))
    failed = [f"FAILED {r['id']}: {r['why']}" for r in rows if r["error"] is None]
    return "\n".join([fmt(head), "  ".join("-" * n for n in w), *map(fmt, body), *failed])


def summary(rows: list[dict]) -> str:
    ok = [r for r in rows if r["error"] is not None]
    out = [f"points: {len(rows)}   compiled: {len(ok)}   failed: {len(rows) - len(ok)}"]
    if ok:
        a = [abs(r["error"]) for r in ok]
        out.append(f"median |error|: {100 * statistics.median(a):.1f}%   max |error|: {100 * max(a):.1f}%   "
                   f"mean signed error: {100 * statistics.mean(r['error'] for r in ok):+.1f}%   "
                   f"optimistic (predicted > published): {sum(r['error'] > 0 for r in ok)}/{len(ok)}")
    for key in ("device_class", "file"):
        out.append(f"by {key}:")
        for k in sorted({r["point"][key] for r in rows}):
            grp = [r for r in rows if r["point"][key] == k]
            e = [abs(r["error"]) for r in grp if r["error"] is not None]
            med = f"median |error| {100 * statistics.median(e):6.1f}%" if e else "no compiled point"
            out.append(f"  {k:40s} {len(grp):3d} points  {med}")
    return "\n".join(out)


def parse_constants(items: list[str], flag: str) -> dict:
    """NAME=V (--set) or NAME=V1,V2,... (--fit) -> {name: value or [values]}."""
    out = {}
    for item in items:
        name, _, vals = item.partition("=")
        if name not in EFFICIENCY_KEYS + LATENCY_KEYS or not vals:
            raise SystemExit(f"{flag} {item}: expected NAME=VALUE with NAME one of {EFFICIENCY_KEYS + LATENCY_KEYS}")
        values = [float(v) for v in vals.split(",")]
        out[name] = values if flag == "--fit" else values[0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA, help="Directory of published-point files.")
    ap.add_argument("--python", default=None,
                    help="Run each compile as `PYTHON -m hetplan` in its own process (default: in this process).")
    ap.add_argument("--check", action="store_true", help="Validate the files and exit.")
    ap.add_argument("--only", action="append", default=[], help="Keep points whose id contains this (repeatable).")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="A constant for every node.yaml.")
    ap.add_argument("--fit", action="append", default=[], metavar="NAME=V1,V2,...", help="Grid-fit this constant.")
    ap.add_argument("--fit-class", action="append", default=[], choices=CLASSES, help="Fit on this class only.")
    ap.add_argument("--fit-classes", action="store_true",
                    help="Fit every per-device-class constant of hetplan.presets.device_classes "
                         "(bench/published_fit.py), with leave-one-out errors.")
    ap.add_argument("--fit-steps", default=None, metavar="S1,S2,...",
                    help="The descent's multiplicative steps, largest first (default 1.4,1.1).")
    ap.add_argument("--json", type=Path, help="Also write rows (and the fit) as JSON here.")
    ap.add_argument("--keep", type=Path, help="Keep each point's node.yaml, config.json and plan.json here.")
    ap.add_argument("-v", "--verbose", action="store_true", help="Print each hetplan command line.")
    args = ap.parse_args(argv)

    points, problems = load_points(args.data)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    if args.only:
        points = [p for p in points if any(s in p["id"] for s in args.only)]
    if args.check:
        print(f"{len(points)} points OK")
        return 0
    overrides = parse_constants(args.set, "--set")
    runner = Runner(args.python, args.keep, args.verbose)
    rows = []
    for p in points:
        pred, why = runner.predict(p, overrides)
        rows.append({"id": p["id"], "point": p, "predicted": pred, "error": rel_err(pred, p["value"]), "why": why})
    print("constants: " + (", ".join(f"{k}={v:g}" for k, v in overrides.items()) or "hetplan defaults"))
    print(table(rows) + "\n\n" + summary(rows))
    result = {"constants": overrides, "rows": [{k: v for k, v in r.items() if k != "point"} | {
        **{k: r["point"][k] for k in ("value", "unit", "metric", "device_class", "strategy", "setting", "source")}}
        for r in rows]}
    if args.fit_classes:
        import published_fit
        from published_fit import Fitter, report
        if args.fit_steps:
            published_fit.STEPS = tuple(float(x) for x in args.fit_steps.split(","))
        fit = Fitter([r["point"] for r in rows], runner).fit(
            log=lambda line: print(line, file=sys.stderr, flush=True) if args.verbose else None)
        result["fit_classes"] = fit
        print("\n" + report(fit))
    if args.fit:
        grids = parse_constants(args.fit, "--fit")
        sel = [p for p in points if not args.fit_class or p["device_class"] in args.fit_class]
        fit = fit_constants(sel, grids, runner, base=overrides)
        result["fit"] = fit
        print(f"\nfit over {fit['points_used']} of {len(sel)} points (the rest never compile), "
              f"{fit['combinations']} combinations: "
              + ", ".join(f"{k}={v:g}" for k, v in fit["constants"].items())
              + f"   median |error| {100 * fit['median_abs_error']:.1f}%")
        if fit["loo_median_abs_error"] is not None:
            print(f"leave-one-out: median |error| {100 * fit['loo_median_abs_error']:.1f}%   "
                  f"max |error| {100 * fit['loo_max_abs_error']:.1f}%")
        for h in fit["loo"]:
            e = "FAILED" if h["error"] is None else f"{100 * h['error']:+.1f}%"
            print(f"  {h['id']:70s} {e:>8s}  " + ", ".join(f"{k}={v:g}" for k, v in h["constants"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0 if any(r["predicted"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
