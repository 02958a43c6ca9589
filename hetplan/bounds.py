"""Physical lower bounds on a phase's makespan, independent of placement.

Every byte a forward pass reads is read from HBM by the GPU, from DRAM by the CPU, or carried
over PCIe; every FLOP runs on one of the two devices. With HBM able to hold at most ``cap``
resident bytes, no plan under this cost model can beat

    t >= max( B / (bw_gpu + bw_cpu + bw_h2d),  (B - cap) / (bw_cpu + bw_h2d),
              F / (peak_gpu + peak_cpu) )

where B is the bytes the phase's stages read, F their FLOPs, and every bandwidth and peak is
the cost model's achievable one (spec value times its efficiency).
"""

from __future__ import annotations

from hetplan.dtypes import compute_dtype
from hetplan.problem import Problem


def phase_lower_bound_s(problem: Problem, phase: str) -> float:
    stages = problem.graph.stages[phase]
    nbytes = sum(st.work.bytes for st in stages)
    flops = sum(st.work.flops for st in stages)
    cap = max(0.0, problem.gpu_budget_bytes - problem.gpu_workspace_bytes)
    return work_lower_bound_s(problem.hw, problem.model, nbytes, flops, cap)


def work_lower_bound_s(hw, spec, nbytes: float, flops: float, cap: float, distinct: float | None = None) -> float:
    """The bound above for ``nbytes`` read and ``flops`` computed with at most ``cap`` bytes
    resident in HBM (any smaller ``cap`` or fewer bytes gives a weaker, still valid bound).
    ``distinct``: of those bytes, the ones that exist before the phase and are each read (a
    dense block's weights), which alone must come from DRAM beyond ``cap``; activations and
    caches written in the phase and read again may all sit in HBM (None: every byte read is
    taken as distinct, as ``phase_lower_bound_s`` has it)."""
    eff = hw.efficiency
    cpu_bw = hw.cpu.mem_bytes_per_s * eff["cpu_mem"]
    cpu_peak = hw.cpu.peak_flops("fp32" if spec.weight_dtype == "fp32" else "bf16") * eff["cpu_flops"]
    if hw.gpu is None:
        return max(nbytes / cpu_bw, flops / cpu_peak)
    gpu_bw = hw.gpu.mem_bytes_per_s * eff["gpu_mem"]
    link_bw = hw.h2d_bytes_per_s * eff["link"]
    gpu_peak = hw.gpu.peak_flops(compute_dtype(spec.weight_dtype)) * eff["gpu_flops"]
    beyond = max(0.0, (nbytes if distinct is None else distinct) - cap)
    return max(nbytes / (gpu_bw + cpu_bw + link_bw), beyond / (cpu_bw + link_bw),
               flops / (gpu_peak + cpu_peak))
