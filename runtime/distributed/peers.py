"""The process group of a pipeline run and the point-to-point messages between its stages.

``join`` rendezvouses (``init_process_group``: ``tcp://`` for the local launcher, ``env://`` under
torchrun) with one timeout for the rendezvous and for every later message; NCCL when the stages
run on CUDA GPUs, gloo otherwise. ``Peers`` sends with ``isend`` (the sender goes on at once and
waits for the send only when it needs the buffer again, or at the end) and receives with
``irecv``, a receive posted ahead (``post``) so that the message lands while the stage computes;
every failure of torch.distributed (a peer whose connection closed, a timeout) becomes
a one-line ``HetplanError`` that names this stage, the peer and what was being exchanged.

With replicas (``ranks.Ranks``) a process names its peers by their stage in its own replica; its
messages go to that replica's processes only. The replicas exchange nothing but a heartbeat:
every replica's first stage joins a small ``all_reduce`` (``beat``) at each decode step, waited
for at the next one, so that when a replica stops, the first stages of the others stop at their
next step (and their stages after them, whose messages from them then fail), instead of running
to the end of their generation first.

Knows nothing about models, plans or what the tensors hold.
"""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist

from hetplan.errors import HetplanError


def _reason(e: BaseException) -> str:
    """The first sentence of a torch.distributed error, without its source location (gloo adds
    advice after it)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"\[[^\]]*\.(cc|cpp|h|hpp):\d+\]\s*", "", text).strip()
    return re.split(r"\.\s+(?=[A-Z])", text, maxsplit=1)[0].rstrip(".")


def join(rank: int, world: int, backend: str, init_method: str, timeout_s: float, name: str) -> None:
    """Rendezvous with the other ``world - 1`` processes, or a HetplanError within ``timeout_s``."""
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - a store or transport failure, told in one line
        raise HetplanError(f"{name}: the rendezvous at {init_method} with the other {world - 1} stage process(es) "
                           f"did not complete within {timeout_s:g} s ({_reason(e)}); start one process per "
                           f"stage with the same address, or raise --dist-timeout") from None


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class Peers:
    """This stage's messages to and from the others of its replica (peers named by stage)."""

    def __init__(self, ranks, rank: int, device: torch.device, timeout_s: float):
        """``ranks``: the run's ``ranks.Ranks``; ``rank``: this process's; ``device``: where
        messages live (the CPU for gloo, this process's GPU for NCCL). Every process of the run
        makes its Peers at the same point (the replicas' heartbeat group is made here)."""
        self.ranks, self.rank, self.world = ranks, rank, ranks.world
        self.replica, self.stage = ranks.split(rank)
        self.device, self.name, self.timeout_s = device, ranks.name(rank), timeout_s
        self.sending = []   # (work, tensor, peer, what): sends not yet known to be done
        self.beats, self.beating, self.pulse = None, None, None
        if ranks.replicas > 1:   # every process takes part in making a group, members or not
            group = dist.new_group(ranks.first_stages(), timeout=datetime.timedelta(seconds=timeout_s))
            if self.stage == 0:
                self.beats, self.pulse = group, torch.zeros(1, device=device)

    def _global(self, stage: int) -> int:
        return self.ranks.rank(self.replica, stage)

    def _failed(self, e: BaseException, peer: int, what: str) -> HetplanError:
        them = self.ranks.name(self._global(peer))
        return HetplanError(f"{self.name}: {what} {them} failed: {_reason(e)}; {them} stopped or did not answer "
                            f"within {self.timeout_s:g} s (--dist-timeout), so this one stops too")

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        """Start sending ``tensor`` (made contiguous on ``device``, copied: the caller may reuse
        its buffer) to stage ``peer`` of this replica."""
        t = tensor.to(self.device, copy=True).contiguous()
        try:
            self.sending.append((dist.isend(t, self._global(peer)), t, peer, what))
        except Exception as e:  # noqa: BLE001
            raise self._failed(e, peer, what) from None

    def post(self, shape: tuple, dtype: torch.dtype, peer: int, what: str) -> "Incoming":
        """Start receiving the next tensor stage ``peer`` of this replica sends (``shape``,
        ``dtype``); ``wait`` on the answer returns it. Receives from one peer are matched in the
        order they are posted."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(t, self._global(peer))
        except Exception as e:  # noqa: BLE001
            raise self._failed(e, peer, what) from None
        return Incoming(self, work, t, peer, what)

    def beat(self) -> None:
        """The replicas' heartbeat (module docstring): wait for the last one, start the next. A
        no-op but on a first stage of a run with replicas."""
        if self.beats is None:
            return
        self._settle()
        try:
            self.beating = dist.all_reduce(self.pulse, group=self.beats, async_op=True)
        except Exception as e:  # noqa: BLE001
            raise self._no_beat(e) from None

    def _settle(self) -> None:
        if self.beating is None:
            return
        try:
            self.beating.wait()
        except Exception as e:  # noqa: BLE001
            raise self._no_beat(e) from None
        self.beating = None

    def _no_beat(self, e: BaseException) -> HetplanError:
        return HetplanError(f"{self.name}: hearing from the other replicas failed: {_reason(e)}; a replica stopped "
                            f"or did not answer within {self.timeout_s:g} s (--dist-timeout), so this one stops too")

    def recv(self, shape: tuple, dtype: torch.dtype, peer: int, what: str) -> torch.Tensor:
        """The next tensor ``peer`` sends (``shape``, ``dtype``), once it has arrived."""
        return self.post(shape, dtype, peer, what).wait()

    def reap(self, every: bool = False) -> None:
        """Wait for the sends that are done (``every``: for all of them, and the last heartbeat)."""
        if every:
            self._settle()
        keep = []
        for work, t, peer, what in self.sending:
            try:
                if every or work.is_completed():
                    work.wait()
                    continue
            except Exception as e:  # noqa: BLE001
                raise self._failed(e, peer, what) from None
            keep.append((work, t, peer, what))
        self.sending = keep

    def barrier(self) -> None:
        """Every process of the run (every replica's)."""
        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: waiting for every stage failed: {_reason(e)}; a stage stopped or "
                               f"did not answer within {self.timeout_s:g} s (--dist-timeout)") from None

    def all_gather(self, obj) -> list:
        """Every process's ``obj`` (by rank), on every process."""
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: hearing from every stage failed: {_reason(e)}; a stage stopped or "
                               f"did not answer within {self.timeout_s:g} s (--dist-timeout)") from None
        return out

    def gather(self, obj, dst: int) -> list | None:
        """Every process's ``obj`` (by rank) on rank ``dst`` (None elsewhere)."""
        out = [None] * self.world if self.rank == dst else None
        try:
            dist.gather_object(obj, out, dst=dst)
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: collecting the stages' measurements failed: {_reason(e)}") from None
        return out


class Incoming:
    """A posted receive."""

    def __init__(self, peers: Peers, work, tensor: torch.Tensor, peer: int, what: str):
        self.peers, self.work, self.tensor, self.peer, self.what = peers, work, tensor, peer, what

    def wait(self) -> torch.Tensor:
        """The tensor, once it has arrived (and the sends that are done, reaped)."""
        try:
            self.work.wait()
        except Exception as e:  # noqa: BLE001
            raise self.peers._failed(e, self.peer, self.what) from None
        self.peers.reap()
        return self.tensor
