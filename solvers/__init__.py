"""Placement strategies. Every strategy maps a Problem to a Decision; ``hetplan.compiler`` turns
Decisions into Plans, so all strategies return the same Plan type.

- ``ilp``: the exact MILP (``ilp.py``, constraint families in ``ilp_constraints.py``).
- baselines a user would otherwise pick (``baselines.py``): ``all-gpu``, ``greedy``
  (Accelerate-style), ``ngl[:N]`` (llama.cpp-style), ``stream`` (FlexGen-style).
"""
