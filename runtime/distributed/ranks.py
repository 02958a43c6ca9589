"""Which process runs what in a pipeline run with replicas: ``R`` replicas of a pipeline of
``S`` stages are ``R x S`` processes, replica ``r``'s stage ``s`` being rank ``r x S + s``; each
replica's stages pass messages along their own chain, and the run's result is gathered on the
last rank (the last replica's last stage). Where a replica's stage runs: the stage's GPU moved
on by ``r x gpus`` (``pipeline.replica_step.gpus``: replicas side by side on one node), or the
same GPU on node ``node + r x nodes`` (``replica_step.nodes``: each replica on nodes of its own).

Pure Python over plan.json's ``pipeline``: no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import HetplanError


@dataclass(frozen=True)
class Ranks:
    replicas: int
    stages: int
    gpu_step: int = 0
    """GPUs between replica ``r`` and ``r + 1`` on one node (0: each replica on nodes of its own)."""

    @staticmethod
    def of(pipeline: dict) -> "Ranks":
        """The ranks of plan.json's ``pipeline``."""
        r, s = pipeline.get("replicas") or 1, len(pipeline["stages"])
        step = pipeline.get("replica_step") or {}
        if r > 1 and not step:
            raise HetplanError(f"plan pipeline: {r} replicas, but no replica_step saying where each runs (written by "
                               f"an older hetplan); recompile the plan with `hetplan compile`")
        return Ranks(r, s, step.get("gpus") or 0)

    @property
    def world(self) -> int:
        return self.replicas * self.stages

    @property
    def reporter(self) -> int:
        """The rank the run's result is gathered on."""
        return self.world - 1

    def split(self, rank: int) -> tuple[int, int]:
        """rank -> (replica, stage)."""
        return divmod(rank, self.stages)

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage

    def first_stages(self) -> list:
        """Every replica's first stage's rank."""
        return [self.rank(r, 0) for r in range(self.replicas)]

    def name(self, rank: int) -> str:
        """How a process is named in what it says: ``stage s``, or ``replica r stage s``."""
        r, s = self.split(rank)
        return f"stage {s}" if self.replicas == 1 else f"replica {r} stage {s}"

    def gpu(self, rank: int, stage_gpu: int | None) -> int | None:
        """The GPU index on its node where ``rank`` runs its stage (planned on ``stage_gpu``)."""
        if stage_gpu is None:
            return None
        return stage_gpu + self.split(rank)[0] * self.gpu_step
