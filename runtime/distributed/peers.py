"""The process group of a pipeline run and the point-to-point messages between its stages.

``join`` rendezvouses (``init_process_group``: ``tcp://`` for the local launcher, ``env://`` under
torchrun) with one timeout for the rendezvous and for every later message; NCCL when the stages
run on CUDA GPUs, gloo otherwise. ``Peers`` sends with ``isend`` (the sender goes on at once and
waits for the send only when it needs the buffer again, or at the end) and receives with
``irecv``, a receive posted ahead (``post``) so that the message lands while the stage computes;
every failure of torch.distributed (a peer whose connection closed, a timeout) becomes
a one-line ``HetplanError`` that names this stage, the peer and what was being exchanged.

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
    """This stage's messages to and from the others."""

    def __init__(self, rank: int, world: int, device: torch.device, name: str, timeout_s: float):
        """``device``: where messages live (the CPU for gloo, this process's GPU for NCCL)."""
        self.rank, self.world, self.device, self.name, self.timeout_s = rank, world, device, name, timeout_s
        self.sending = []   # (work, tensor, peer, what): sends not yet known to be done

    def _failed(self, e: BaseException, peer: int, what: str) -> HetplanError:
        return HetplanError(f"{self.name}: {what} stage {peer} failed: {_reason(e)}; stage {peer} stopped or "
                            f"did not answer within {self.timeout_s:g} s (--dist-timeout), so this one stops too")

    def send(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        """Start sending ``tensor`` (made contiguous on ``device``, copied: the caller may reuse
        its buffer) to ``peer``."""
        t = tensor.to(self.device, copy=True).contiguous()
        try:
            self.sending.append((dist.isend(t, peer), t, peer, what))
        except Exception as e:  # noqa: BLE001
            raise self._failed(e, peer, what) from None

    def post(self, shape: tuple, dtype: torch.dtype, peer: int, what: str) -> "Incoming":
        """Start receiving the next tensor ``peer`` sends (``shape``, ``dtype``); ``wait`` on
        the answer returns it. Receives from one peer are matched in the order they are posted."""
        t = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            work = dist.irecv(t, peer)
        except Exception as e:  # noqa: BLE001
            raise self._failed(e, peer, what) from None
        return Incoming(self, work, t, peer, what)

    def recv(self, shape: tuple, dtype: torch.dtype, peer: int, what: str) -> torch.Tensor:
        """The next tensor ``peer`` sends (``shape``, ``dtype``), once it has arrived."""
        return self.post(shape, dtype, peer, what).wait()

    def reap(self, every: bool = False) -> None:
        """Wait for the sends that are done (``every``: for all of them)."""
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
        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: waiting for every stage failed: {_reason(e)}; a stage stopped or "
                               f"did not answer within {self.timeout_s:g} s (--dist-timeout)") from None

    def all_gather(self, obj) -> list:
        """Every stage's ``obj``, on every stage."""
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: hearing from every stage failed: {_reason(e)}; a stage stopped or "
                               f"did not answer within {self.timeout_s:g} s (--dist-timeout)") from None
        return out

    def gather(self, obj, dst: int) -> list | None:
        """Every stage's ``obj`` on stage ``dst`` (None elsewhere)."""
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
