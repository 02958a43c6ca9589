"""Progress of long steps, and Ctrl-C inside them.

Library code calls ``note(text)`` at each step that may take seconds (building a problem, each
MILP configuration, with its incumbent and bound); nothing is shown unless the caller installed
a sink with ``reporting(sink)`` (the CLI prints to stderr), and a step's lines start only once
it has run ``QUIET_S`` seconds, so quick commands stay silent. ``interruptible()`` lets a solve
running in native code notice Ctrl-C: SIGINT sets a flag that the solver's callback polls.
Knows nothing about what the steps are.
"""

from __future__ import annotations

import contextlib
import contextvars
import signal
import threading
import time

QUIET_S = 2.0
"""A step shows progress only after running this long."""
EVERY_S = 2.0
"""Seconds between two progress lines of one step."""

_SINK: contextvars.ContextVar = contextvars.ContextVar("hetplan_progress_sink", default=None)


@contextlib.contextmanager
def reporting(sink):
    """Send ``note`` lines to ``sink(text)`` inside the block."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


def note(text: str) -> None:
    sink = _SINK.get()
    if sink is not None:
        sink(text)


class Ticker:
    """Rate-limits a step's progress lines: ``due()`` is true once ``QUIET_S`` has passed since
    the step began and then every ``EVERY_S``."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.next = self.t0 + QUIET_S

    def due(self) -> bool:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + EVERY_S
            return True
        return False

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0


class Interrupt:
    """Set when Ctrl-C arrived during ``interruptible()``."""

    def __init__(self):
        self.requested = False


@contextlib.contextmanager
def interruptible():
    """Inside the block SIGINT only sets ``flag.requested`` (native code polls it through a
    callback and stops); on leaving, a requested interrupt is raised as KeyboardInterrupt.
    Outside the main thread it changes nothing."""
    flag = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag.requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
    if flag.requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def step(label: str):
    """A step that says ``label`` (once) if it is still running after ``QUIET_S`` seconds."""
    sink = _SINK.get()
    timer = None
    if sink is not None:
        timer = threading.Timer(QUIET_S, sink, args=(f"{label} ...",))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
