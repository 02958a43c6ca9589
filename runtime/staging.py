"""Streamed blocks' weights copied into the staging ring ahead of their compute, in a fixed order.

``hetplan exec`` runs a plan's ``load`` tasks from its task DAG (``runtime/executor.py``); a
runtime without a DAG (``hetplan serve``'s forward over paged KV) steps through the blocks in
order and drives the same ``Residency`` slots with a ``StagingRing``: ``start(order)`` takes a
forward's streamed blocks as [(block, slot)] in the order they compute and issues the copies
whose slots are free; ``ready(block)`` makes the caller wait until the block's weights are in its
slot; ``release(block)`` says the block's stages were issued, which frees its slot for the next
block queued on it and issues that copy. With ``depth`` slots assigned round-robin (the plan's
``load`` tasks carry them, ``streamed_slots``), a block's copy starts once the block ``depth``
places before it has computed: one slot copies while the other computes (double buffering),
and no more than the plan's staging bytes (``depth`` slots of the largest streamed block) is
ever held.

- On a real GPU a copy is issued on the ``h2d`` stream out of pinned host memory without blocking
  the host; it waits (``wait_event``) for the compute that last read its slot, and the compute
  stream waits for the copy's event before the block's first stage.
- Emulated, a copy runs on a worker thread of its own (the emulated ``h2d`` lane, one intra-op
  thread) into the emulated GPU's counted slot, while the calling thread computes; ``ready`` waits
  for it.

Knows nothing about models or what the blocks compute.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from hetplan.runtime.devices import Devices


def streamed_slots(plan, phase: str) -> dict:
    """block -> staging slot, for every block the plan's ``phase`` streams (its ``load`` tasks)."""
    return {t.block: t.slot for t in plan.schedule[phase].tasks if t.kind == "load"}


def _one_thread() -> None:
    torch.set_num_threads(1)  # the copy lane's own setting; the caller's stays as it was


class StagingRing:
    def __init__(self, residency, devices: Devices):
        self.residency, self.devices = residency, devices
        n = len(residency.slots)
        self._queue: list = []        # (block, slot) not yet issued, in compute order
        self._holder = [None] * n     # slot -> block whose copy was issued into it and not released
        self._slot_of: dict = {}      # block issued -> its slot
        if devices.cuda:
            self.stream = devices.stream("h2d")
            self._loaded = [torch.cuda.Event() for _ in range(n)]
            self._freed = [None] * n  # slot -> event after the last compute that read it
            self._lane = None
        else:
            self._lane = ThreadPoolExecutor(1, thread_name_prefix="hetplan-serve-h2d", initializer=_one_thread)
            self._copies = [None] * n  # slot -> future of its copy

    def start(self, order: list) -> None:
        """Begin a forward whose streamed blocks compute in ``order``, [(block, slot)]; copies left
        by an unfinished forward (one that raised) are finished and their slots freed first."""
        if self._lane is not None:
            for f in self._copies:
                if f is not None:
                    f.result()
        self._holder = [None] * len(self._holder)
        self._slot_of.clear()
        self._queue = list(order)
        self._issue()

    def ready(self, block: str) -> None:
        """Wait until ``block``'s weights are in its slot (on CUDA: the current stream waits)."""
        s = self._slot_of[block]
        if self._lane is not None:
            self._copies[s].result()
        else:
            torch.cuda.current_stream(self.devices.gpu).wait_event(self._loaded[s])

    def release(self, block: str) -> None:
        """``block``'s stages are issued: its slot is free once they end; issue the next copy."""
        s = self._slot_of.pop(block)
        if self._lane is None:
            ev = self._freed[s] or torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.devices.gpu))
            self._freed[s] = ev
        self._holder[s] = None
        self._issue()

    def _issue(self) -> None:
        """Issue queued copies in order while the next one's slot is free."""
        while self._queue and self._holder[self._queue[0][1]] is None:
            block, s = self._queue.pop(0)
            self._holder[s], self._slot_of[block] = block, s
            if self._lane is not None:
                self._copies[s] = self._lane.submit(self.residency.load, block, s)
                continue
            with torch.cuda.stream(self.stream):
                if self._freed[s] is not None:
                    self.stream.wait_event(self._freed[s])
                self.residency.load(block, s)
                self._loaded[s].record(self.stream)

    def close(self) -> None:
        """Stop the emulated copy lane's thread."""
        if self._lane is not None:
            self._lane.shutdown(wait=True)
