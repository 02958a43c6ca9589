"""Plans over several GPUs of one node: contiguous layer ranges as pipeline stages.

Each stage is an ordinary single-GPU problem (``hetplan.problem``) over a slice of the model
(``stages``), solved by the same strategies as a one-GPU node (resident / streamed / CPU, KV
tier per block) on that GPU alone with its own memory budget; ``hetplan.solvers.pipeline``
chooses the stage boundaries (``plan``). Between consecutive stages the hidden state crosses
the link between their GPUs (``cost.peer_seconds``). The host's DRAM is shared: the stages' CPU
bytes together must fit. Knows nothing about torch or about executing a plan.
"""

from hetplan.pipeline.plan import PipelinePlan, StagePlan, pipeline_makespan_s, plan_pipeline
from hetplan.pipeline.stages import hidden_bytes, slice_model, stage_problem, without_ends

__all__ = ["PipelinePlan", "StagePlan", "hidden_bytes", "pipeline_makespan_s", "plan_pipeline", "slice_model",
           "stage_problem", "without_ends"]
