"""Placement strategies. Every strategy maps a Problem to a Decision; ``hetplan.compiler`` turns
Decisions into Plans, so all strategies return the same Plan type.

- ``ilp``: the exact MILPs (``ilp/``: the per-block and count MILPs, their constraint families,
  the expert split and the objective).
- baselines a user would otherwise pick (``baselines.py``): ``all-gpu``, ``greedy``
  (Accelerate ``device_map="auto"``), ``ngl[:N]`` and ``ngl-nkvo[:N]`` (llama.cpp ``-ngl``,
  ``-nkvo``), ``stream`` (FlexGen-style), ``cpu-moe`` and ``n-cpu-moe[:N]`` (llama.cpp).
"""
