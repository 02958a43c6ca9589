"""Fitting hetplan's per-device-class constants to the published points (``published_accuracy.py
--fit-classes``), with leave-one-out errors.

The constants are those of ``hetplan.presets.device_classes``: per GPU class (consumer,
datacenter) ``gpu_mem``, ``gpu_flops``, ``gpu_task``; per CPU class (desktop, server)
``cpu_mem``, ``cpu_flops``, ``cpu_task``; for the link ``link``, ``link_task``. A point depends
on the constants of its GPU's class, its CPU's class (when the CPU is published) and the link
(when there is a GPU and the link is published); its node.yaml gets exactly those.

Loss: the mean over points of |log(predicted / published)| (a failed compile counts as
``FAIL_LOSS``). Search: coordinate descent, each constant multiplied and divided by a step
that shrinks from 1.4 to 1.1, in a fixed order, until no move improves the loss: deterministic,
and every single-constant move around the optimum is compiled in its last pass, so that the
leave-one-out refits (warm-started from the full fit, then descended on the n-1 other points)
cost little. A constant informed by fewer than ``MIN_POINTS`` points (points whose prediction
moves by more than ``SENSITIVE`` when it moves by ``PROBE``) is not fitted: it keeps its
current default and the report says so.
"""

from __future__ import annotations

import math
import statistics

from hetplan.presets.device_classes import CLASS_DEFAULTS, CPU_KEYS, GPU_KEYS, LINK_KEYS

SPACE = {"consumer": GPU_KEYS, "datacenter": GPU_KEYS, "desktop": CPU_KEYS, "server": CPU_KEYS, "link": LINK_KEYS}
BOUNDS = {"gpu_mem": (0.1, 1.0), "cpu_mem": (0.1, 1.0), "link": (0.1, 1.0), "gpu_flops": (0.05, 1.0),
          "cpu_flops": (0.05, 1.0), "gpu_task": (1e-6, 2e-3), "cpu_task": (1e-6, 2e-3), "link_task": (1e-6, 2e-3)}
STEPS = (1.4, 1.1)
"""Multiplicative steps of the descent, largest first (``--fit-steps`` overrides: a leave-one-out pass
from fitted defaults needs only the last)."""
FAIL_LOSS = math.log(10.0)
MIN_POINTS = 3
SENSITIVE = 0.005
PROBE = 1.5
"""A constant informs a point when moving it by PROBE moves the prediction by more than SENSITIVE."""


def point_classes(p: dict) -> list[str]:
    """The classes whose constants a point's prediction depends on."""
    hw, out = p["hardware"], []
    used = lambda part: part.get("published") is not False or part.get("latency_bound") is True
    if hw.get("gpu"):
        out.append(hw["gpu"]["class"].rsplit("_", 1)[0])
    if used(hw["cpu"]):
        out.append(hw["cpu"].get("class", "desktop_cpu").rsplit("_", 1)[0])   # the placeholder is a desktop
    if hw.get("gpu") and used(hw.get("links", {})):
        out.append("link")
    return out


def overrides_for(p: dict, theta: dict) -> dict:
    """node.yaml constants for point ``p`` under ``theta`` ({"consumer.gpu_mem": 0.7, ...})."""
    return {k: theta[f"{c}.{k}"] for c in point_classes(p) for k in SPACE[c]}


def start() -> dict:
    return {f"{c}.{k}": CLASS_DEFAULTS[c][k] for c, keys in SPACE.items() for k in keys}


class Fitter:
    def __init__(self, points: list[dict], runner):
        self.points, self.runner = points, runner

    def pred(self, p: dict, theta: dict) -> float | None:
        return self.runner.predict(p, overrides_for(p, theta))[0]

    def loss(self, theta: dict, points: list[dict]) -> float:
        out = []
        for p in points:
            v = self.pred(p, theta)
            out.append(FAIL_LOSS if v is None else abs(math.log(v / p["value"])))
        return sum(out) / len(out)

    def informing(self, theta: dict, name: str) -> list[str]:
        """Ids of the points whose prediction moves by more than SENSITIVE when ``name`` moves by
        PROBE (down when PROBE would cross its bound)."""
        c = name.split(".")[0]
        up = clip(name, theta[name] * PROBE)
        moved = {**theta, name: up if up != theta[name] else clip(name, theta[name] / PROBE)}
        out = []
        for p in self.points:
            if c not in point_classes(p):
                continue
            a, b = self.pred(p, theta), self.pred(p, moved)
            if a is not None and b is not None and abs(b - a) > SENSITIVE * a:
                out.append(p["id"])
        return out

    def descend(self, theta: dict, points: list[dict], names: list[str], log=None) -> dict:
        theta, best = dict(theta), self.loss(theta, points)
        for step in STEPS:
            improved = True
            while improved:
                improved = False
                for name in names:
                    for f in (step, 1.0 / step):
                        cand = {**theta, name: clip(name, theta[name] * f)}
                        if cand[name] == theta[name]:
                            continue
                        v = self.loss(cand, points)
                        if v < best - 1e-12:
                            theta, best, improved = cand, v, True
                            if log:
                                log(f"  {name} = {theta[name]:.4g}  loss {best:.4f}")
                            break
        return theta

    def fit(self, log=None) -> dict:
        theta0 = start()
        counts = {n: self.informing(theta0, n) for n in theta0}
        names = [n for n in theta0 if len(counts[n]) >= MIN_POINTS]
        theta = self.descend(theta0, self.points, names, log)
        counts_fit = {n: self.informing(theta, n) for n in theta}
        errors = {p["id"]: err(self.pred(p, theta), p["value"]) for p in self.points}
        loo = {}
        for i, p in enumerate(self.points):
            rest = self.points[:i] + self.points[i + 1:]
            held = self.descend(theta, rest, names)
            loo[p["id"]] = {"error": err(self.pred(p, held), p["value"]),
                            "moved": {n: held[n] for n in names if held[n] != theta[n]}}
            if log:
                e = loo[p["id"]]["error"]
                log(f"  leave out {p['id']}: {'FAILED' if e is None else f'{100 * e:+.1f}%'}")
        return {"constants": theta, "fitted": names, "informing": {n: counts_fit[n] for n in theta},
                "informing_at_start": {n: counts[n] for n in theta}, "errors": errors, "loo": loo,
                "loss": self.loss(theta, self.points)}


def clip(name: str, v: float) -> float:
    lo, hi = BOUNDS[name.split(".")[1]]
    return float(f"{min(max(v, lo), hi):.3g}")


def err(pred: float | None, pub: float) -> float | None:
    return None if pred is None else (pred - pub) / pub


def report(result: dict) -> str:
    th, out = result["constants"], []
    out.append(f"fitted {len(result['fitted'])} of {len(th)} constants, mean |log error| {result['loss']:.4f}")
    for n in th:
        k = len(result["informing"][n])
        tag = "fitted" if n in result["fitted"] else f"kept (informed by {len(result['informing_at_start'][n])} < {MIN_POINTS} points)"
        out.append(f"  {n:22s} {th[n]:10.4g}   informed by {k:2d} points   {tag}")
    e = [abs(x) for x in result["errors"].values() if x is not None]
    lo = [abs(v["error"]) for v in result["loo"].values() if v["error"] is not None]
    out.append(f"in-sample: median |error| {100 * statistics.median(e):.1f}%   max {100 * max(e):.1f}%")
    out.append(f"leave-one-out: median |error| {100 * statistics.median(lo):.1f}%   max {100 * max(lo):.1f}%")
    for pid, v in result["loo"].items():
        x = v["error"]
        e_in = result["errors"][pid]
        out.append(f"  {pid:70s} in " + ("FAILED" if e_in is None else f"{100 * e_in:+7.1f}%")
                   + "   left out " + ("FAILED" if x is None else f"{100 * x:+7.1f}%"))
    out.append("CLASS_DEFAULTS = {")
    for c, keys in SPACE.items():
        out.append(f'    "{c}": {{' + ", ".join(f'"{k}": {th[f"{c}.{k}"]:.3g}' for k in keys) + "},")
    out.append("}")
    return "\n".join(out)
