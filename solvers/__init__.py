"""Placement strategies. Every strategy maps a Problem to a Decision; ``hetplan.compiler`` turns
Decisions into Plans, so all strategies return the same Plan type.

- ``ilp``: the exact MILPs (``ilp/``: the per-block and count MILPs, their constraint families,
  the expert split and the objective).
- baselines a user would otherwise pick (``baselines.py``): ``all-gpu``, ``greedy``
  (Accelerate-style), ``ngl[:N]`` (llama.cpp-style), ``stream`` (FlexGen-style), ``cpu-moe`` and
  ``n-cpu-moe[:N]``.
"""
