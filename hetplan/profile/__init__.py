"""Measured machines: the per-op profile table (``node.profile.json``) and how costs read it,
the sanity checks of a profile (impossible values, another machine), and folding a run's trace
into a profile.

``table`` holds the table and its lookups, ``checks`` the checks, ``trace`` the folding. Knows
nothing about torch or how the measurements were taken (``hetplan.runtime.profiler`` measures).
"""

from hetplan.profile.checks import current_machine, profile_problems
from hetplan.profile.table import ProfileTable, load_profile

__all__ = ["ProfileTable", "current_machine", "load_profile", "profile_problems"]
