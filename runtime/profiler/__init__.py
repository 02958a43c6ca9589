"""Measure this machine with torch: the peaks behind node.yaml and the per-op table behind
node.profile.json.

``measure`` runs the measurements within a budget, ``kernels`` says what each measurement
times, ``machine`` reads what the OS and torch report about the machine. Knows nothing about
plans or solvers: the table it writes is read by ``hetplan.profile``.
"""

from hetplan.runtime.profiler.measure import Budget, ProfileResult, profile_machine

__all__ = ["Budget", "ProfileResult", "profile_machine"]
