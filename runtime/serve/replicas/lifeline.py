"""How the processes of replicas served under torchrun learn that the whole must stop, without
any replica waiting on another.

Rank 0 (replica 0's first stage, which also runs the front) and every other process hold a line
to each other on a gloo group of their own (``new_group``, made once at startup by every
process, as is the one exchange of the replicas' addresses, ``gather``). Along each line both
ends send a pulse every ``PULSE_S`` and wait for the other's; nothing of serving goes through it.

- Rank 0 hears from rank ``k``: a pulse (``k`` lives); or the line breaking (``k``'s process
  ended: its connections closed, which gloo tells at once) or no pulse within the group's
  timeout (``--dist-timeout``: ``k``'s node gone silent). Then ``k`` failed: rank 0 tells every
  other process (``FAILED``, ``k``), says one line and exits 2.
- Rank ``k`` hears from rank 0: a pulse; ``STOP`` (rank 0 stops on purpose: ``on_stop``, and
  the line may break from then on); ``FAILED`` (another process failed); or the line breaking
  or going silent (rank 0 failed). Failed: one line, exit 2.
- Ctrl-C on another node than rank 0's: rank ``k`` asks rank 0 to stop (``ask_stop``: ``STOP``
  along its line), and rank 0 stops as on its own Ctrl-C (``on_stop``), telling every process.

A process that fails on its own (``fail``: its engine broke, a message to its stage failed)
says its line and exits 2; its lines close with it, so rank 0 learns at once. Whichever comes
first, a process says one line: ``fail`` holds a lock from then on. Exiting is ``os._exit``,
stopped on purpose too (``end``): a process whose serving is over has nothing to save, and the
threads blocked in receives along its lines, or in a message to a stage that is gone, are not
unwound (leaving the process group under them aborts the process). Knows nothing about HTTP,
engines or models: the processes' names (``ranks.Ranks``) and what to do on ``STOP``.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

from hetplan.errors import HetplanError
from hetplan.runtime.distributed.launch import say
from hetplan.runtime.distributed.peers import _reason

PULSE_S = 1.0
"""Seconds between two pulses along a line (each way)."""
TELL_S = 3.0
"""How long rank 0 waits for the others to take its ``FAILED`` or ``STOP`` before it goes on."""
PULSE, STOP, FAILED = 0, 1, 2
"""What a message along a line says: [kind, the rank it is about]."""


class Lifeline:
    def __init__(self, ranks, rank: int, timeout_s: float):
        """Every process of the run makes its Lifeline at the same point (a collective over the
        world: the group of the lines is made here)."""
        self.ranks, self.rank, self.timeout_s = ranks, rank, timeout_s
        self.name = ranks.name(rank)
        self.peers = list(range(1, ranks.world)) if rank == 0 else [0]
        try:
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: making the replicas' lifeline failed: {_reason(e)}; a process "
                               f"stopped or did not answer within {timeout_s:g} s (--dist-timeout)") from None
        self.stopping = threading.Event()
        """Set once the whole stops on purpose (``stop_all`` on rank 0, ``STOP`` elsewhere)."""
        self._ending = threading.Lock()
        self._on_stop = None

    def gather(self, obj) -> list:
        """Every process's ``obj`` (by rank), on every process: once, at startup, before ``start``
        (so that no collective on the group runs beside the pulses' point-to-point messages)."""
        out = [None] * self.ranks.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:  # noqa: BLE001
            raise HetplanError(f"{self.name}: exchanging the replicas' addresses failed: {_reason(e)}; a process "
                               f"stopped or did not answer within {self.timeout_s:g} s (--dist-timeout)") from None
        return out

    def start(self, on_stop) -> None:
        """Pulse and listen along every line of this process; ``on_stop()`` (rank ``k`` > 0, on a
        thread) once rank 0 says ``STOP``."""
        self._on_stop = on_stop
        for peer in self.peers:
            threading.Thread(target=self._listen, args=(peer,), name=f"hetplan-lifeline-{peer}", daemon=True).start()
            threading.Thread(target=self._pulse, args=(peer,), name=f"hetplan-pulse-{peer}", daemon=True).start()

    def _pulse(self, peer: int) -> None:
        while not self.stopping.wait(PULSE_S):
            try:
                dist.send(torch.tensor([PULSE, self.rank]), peer, group=self.group)
            except Exception:  # noqa: BLE001 - the line is broken: its listener says so
                return

    def _listen(self, peer: int) -> None:
        them = self.ranks.name(peer)
        while True:
            msg = torch.zeros(2, dtype=torch.int64)
            try:
                dist.recv(msg, peer, group=self.group)
            except Exception as e:  # noqa: BLE001
                if self.stopping.is_set():
                    return
                if self.rank == 0:
                    self.fail(f"{self.name}: {them} stopped ({_reason(e)}); every process of every replica was "
                              f"stopped, the requests in flight cut off", culprit=peer)
                else:
                    self.fail(f"{self.name}: {them}, which runs the front, stopped ({_reason(e)}); this process "
                              f"stops too")
                return
            kind, about = msg.tolist()
            if kind == STOP and self.rank == 0:   # rank ``peer`` asks for the whole to stop (Ctrl-C there)
                if self._on_stop is not None and not self.stopping.is_set():
                    self._on_stop()
                continue
            if kind == STOP:
                self.stopping.set()
                if self._on_stop is not None:
                    self._on_stop()
                return
            if kind == FAILED:
                self.fail(f"{self.name}: stopped, since {self.ranks.name(about)} stopped (rank 0's line says how); "
                          f"every process of every replica stops")
                return

    def fail(self, line: str, culprit: int | None = None, code: int = 2) -> None:
        """End this process with ``line`` (one line, exit ``code``), the first caller only; on
        rank 0, every other process is told first (``FAILED``, ``culprit``: this one by default)."""
        self._ending.acquire()   # held until the process ends: no second line
        if self.rank == 0:
            self._tell(FAILED, self.rank if culprit is None else culprit)
        say(line)
        os._exit(code)

    def end(self, code: int = 0) -> None:
        """End this process once it stopped on purpose (its output flushed): its lines, blocked
        in receives on threads of their own, are not unwound."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    def ask_stop(self) -> None:
        """Rank ``k`` > 0 (Ctrl-C on its node) asks rank 0 to stop every process; returns at once
        (a signal handler's call)."""
        def ask():
            try:
                dist.send(torch.tensor([STOP, self.rank]), 0, group=self.group)
            except Exception:  # noqa: BLE001 - rank 0 gone: the listener says so
                pass
        if self.rank != 0:
            threading.Thread(target=ask, name="hetplan-lifeline-ask", daemon=True).start()

    def stop_all(self) -> None:
        """Rank 0 stops on purpose: tell every other process ``STOP``."""
        if self.rank != 0 or self.stopping.is_set():
            return
        self.stopping.set()
        self._tell(STOP, 0)

    def _tell(self, kind: int, about: int) -> None:
        """Send [kind, about] to every other process, waiting at most ``TELL_S`` in all (a
        process already gone fails at once; one gone silent is not waited for)."""
        def tell(peer):
            try:
                dist.send(torch.tensor([kind, about]), peer, group=self.group)
            except Exception:  # noqa: BLE001 - gone already
                pass
        threads = [threading.Thread(target=tell, args=(p,), daemon=True) for p in self.peers if p != about]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TELL_S)
