"""The chain DP: MoE placements decided exactly over the block chain, where the makespan is a
sum of terms over consecutive blocks and memory is the only coupling.

- ``dp``: the search (Lagrangian bounds on the memory rows, a pruned Pareto front per block);
- ``cells``: plans that fill the GPU with whole blocks (a shortest path over HBM cells);
- ``grid``: a bound and a plan with the memory row rounded onto a grid, past the fronts' limit;
- ``plan``: the plan found, priced, and the MILP where the DP's rows leave something out.

Knows the MILP's rows (through ``options``) and the schedule's chain; knows nothing about HiGHS
or the plan's format.
"""
