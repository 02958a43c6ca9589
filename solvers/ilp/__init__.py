"""The placement MILPs (exact for the task chain at exclusive bandwidths, a lower bound on the
replay once tasks share a bus), solved by HiGHS through PuLP.

``solve`` (in ``per_block``) runs one MILP per configuration (staging depth, slot size): the count
MILP of ``layers`` when the model's layers are all alike, else the per-block MILP (for a MoE
model, the chain DP of ``chain`` (a package: ``dp``, ``cells``, ``grid``, ``plan``) where it proves the
optimum). Constraint families live in ``constraints`` (one function each, the math in its
docstring), the MoE expert split in ``experts``, and what both minimise, the block-time
formulas and the HiGHS run in ``objective``; ``counts`` reads one LP relaxation of the count
MILP as a bound at every layer count (what the pipeline search learns from). Knows the problem's numbers and the schedule's
task rules; knows nothing about plan files, the CLI or torch.
"""

from hetplan.solvers.ilp.per_block import (IlpOptions, IlpResult, count_bounds, count_lines, lp_bound_s, memory_unit,
                                           solve)

__all__ = ["IlpOptions", "IlpResult", "count_bounds", "count_lines", "lp_bound_s", "memory_unit", "solve"]
