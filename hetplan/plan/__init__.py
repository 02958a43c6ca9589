"""The plan and its readers.

``format`` holds the plan itself (frozen dataclasses, ``to_json``/``from_json``, the schema
version) and the vocabulary every other module speaks; its public names are re-exported here.
``pending`` counts, for plan assembly, the GPU bytes that copies to the host leave waiting.
The readers: ``simulate`` (the independent replay that is the arbiter of what a plan costs,
with ``sharing``, its rule for tasks that share a memory bus, and ``waiting``, its own count of
those bytes),
``check`` (recompile and compare, for CI), ``compare`` (a plan beside every baseline),
``report`` (the ``show`` summary and tables) and ``timeline`` (Gantt charts and traces).
A plan knows nothing about how it was solved or how it will run: it is data.
"""

from hetplan.plan.format import (RESOURCES, SCHEMA_VERSION, TIERS, WEIGHTS, Decision, PhaseSchedule, Plan,
                                 Task, load_plan, write_atomic)

__all__ = ["RESOURCES", "SCHEMA_VERSION", "TIERS", "WEIGHTS", "Decision", "PhaseSchedule", "Plan", "Task",
           "load_plan", "write_atomic"]
