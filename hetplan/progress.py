"""Progress of long steps, and Ctrl-C inside them.

Library code wraps each step that may take seconds in ``step(label)`` (building a problem,
solving it), says what the step is doing now with ``activity(text)`` (which MILP configuration,
the last one's incumbent and bound) and may ``note(text)`` a line at once (a running MILP's
nodes, incumbent and bound). Nothing is shown unless the caller installed a sink with
``reporting(sink)`` (the CLI prints to stderr); a step's lines start only once it has run
``QUIET_S`` seconds, so quick commands stay silent, and from then on a heartbeat repeats the
step's label and activity whenever ``HEARTBEAT_S`` seconds passed without a line, so a long step is
never silent. ``interruptible()`` lets a solve running in native code notice Ctrl-C: SIGINT sets
a flag that the solver's callback polls. Knows nothing about what the steps are.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import select
import signal
import threading
import time

QUIET_S = 2.0
"""A step shows progress only after running this long."""
EVERY_S = 2.0
"""Seconds between two progress lines of one step."""
HEARTBEAT_S = 1.5
"""A running step repeats its label after this long without a line (so no silence reaches 2 s,
the heartbeat's own polling and a loaded machine's scheduling included)."""

_SINK: contextvars.ContextVar = contextvars.ContextVar("hetplan_progress_sink", default=None)


class _Sink:
    """The caller's sink, which remembers when it last printed and what the step is doing."""

    def __init__(self, fn):
        self.fn = fn
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.activity = ""

    def __call__(self, text: str) -> None:
        with self.lock:
            self.fn(text)
            self.last = time.monotonic()


@contextlib.contextmanager
def reporting(sink):
    """Send progress lines to ``sink(text)`` inside the block."""
    token = _SINK.set(_Sink(sink))
    try:
        yield
    finally:
        _SINK.reset(token)


def note(text: str) -> None:
    """Print ``text`` now (when a sink is installed)."""
    sink = _SINK.get()
    if sink is not None:
        sink(text)


def activity(text: str) -> None:
    """What the current step is doing; the heartbeat shows it (nothing is printed now)."""
    sink = _SINK.get()
    if sink is not None:
        sink.activity = text


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


GRACE_S = 0.5
"""How long native code inside ``interruptible()`` has to notice Ctrl-C before the process ends
without it (a solver's presolve polls no callback)."""


@contextlib.contextmanager
def interruptible():
    """Inside the block SIGINT only sets ``flag.requested`` (native code polls it through a
    callback and stops); on leaving, a requested interrupt is raised as KeyboardInterrupt.
    Guarded by ``_watchdog`` (native code may poll rarely: a solver's presolve calls no
    callback). Outside the main thread it changes nothing."""
    flag = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        flag.requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with _watchdog(flag):
            yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
    if flag.requested:
        raise KeyboardInterrupt


@contextlib.contextmanager
def cancellable():
    """Ctrl-C inside the block raises KeyboardInterrupt as usual, and ``_watchdog`` ends the
    process if a long native call (a torch op) keeps Python from seeing it. For blocks that write
    nothing (measuring, running a model); outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _watchdog(Interrupt()):
        yield


@contextlib.contextmanager
def _watchdog(flag: Interrupt):
    """Python sees a signal only when the main thread runs Python again, which a long native call
    delays; a watcher thread learns of SIGINT at once through ``signal.set_wakeup_fd``, sets
    ``flag.requested``, and if the block has not ended ``GRACE_S`` later, the process exits there
    with code 130 and the CLI's one line. That is safe because the blocks guarded write nothing,
    and every file hetplan writes is renamed into place whole."""
    left = threading.Event()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch():
        while not left.is_set():
            ready, _, _ = select.select([read_fd], [], [], 0.1)
            if ready and signal.SIGINT in os.read(read_fd, 64):
                flag.requested = True
                if not left.wait(GRACE_S):
                    # a progress line on a terminal may be open: end it first
                    os.write(2, (b"\n" if os.isatty(2) else b"") + b"hetplan: interrupted; nothing was written\n")
                    os._exit(130)

    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="hetplan-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        left.set()
        signal.set_wakeup_fd(previous_fd)
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


@contextlib.contextmanager
def step(label: str, long: bool = False):
    """A step that says ``label`` if it is still running after ``QUIET_S`` seconds (at once when
    it is known to be ``long``), then repeats it with its activity and elapsed time whenever
    ``HEARTBEAT_S`` seconds passed without a line."""
    sink = _SINK.get()
    if sink is None:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()
    sink.activity = ""

    def heartbeat():
        if not long and done.wait(QUIET_S):
            return
        sink(f"{label} ...")
        while not done.wait(0.25):
            now = time.monotonic()
            if now - sink.last >= HEARTBEAT_S:
                doing = f": {sink.activity}" if sink.activity else ""
                sink(f"{label}{doing} ({now - t0:.0f} s)")

    beat = threading.Thread(target=heartbeat, name="hetplan-progress", daemon=True)
    beat.start()
    try:
        yield
    finally:
        done.set()
        beat.join()
        sink.activity = ""
