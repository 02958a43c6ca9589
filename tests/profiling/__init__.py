"""Profiles: the measured table, its checks, trace folding and a real profiling run."""
