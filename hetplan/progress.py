"""Progress of long steps, and Ctrl-C inside them.

Library code wraps each step that may take seconds in ``step(label)`` (building a problem,
solving it), says what the step is doing now with ``activity(text)`` (which MILP configuration,
the last one's incumbent and bound) and may ``note(text)`` a line at once (a running MILP's
nodes, incumbent and bound). Nothing is shown unless the caller installed a sink with
``reporting(sink)`` (the CLI prints to stderr); lines start only once the command has run
``QUIET_S`` seconds, so quick commands stay silent, and from then on one heartbeat thread prints
the innermost step's label and activity (or that the command is still working) whenever
``HEARTBEAT_S`` seconds passed without a line, so a long command is never silent. ``interruptible()`` lets a solve running in native code notice Ctrl-C: SIGINT sets
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
"""A command shows progress only after running this long (a ``long`` step: at once)."""
EVERY_S = 2.0
"""Seconds between two progress lines that a running MILP's callback notes."""
HEARTBEAT_S = 1.0
"""Once a command has shown progress, the heartbeat prints a line whenever this long passed
without one, so a loaded machine's scheduling (a few tenths of a second at load 9 on 2 cores)
still leaves no silence above about 1.5 s."""

_SINK: contextvars.ContextVar = contextvars.ContextVar("hetplan_progress_sink", default=None)


class _Sink:
    """The caller's sink: when a line was last printed (by it or, through ``printed()``, by the
    command itself), which steps are running (innermost last) and what the innermost is doing.
    Its heartbeat thread is the only one that prints on its own."""

    def __init__(self, fn):
        self.fn = fn
        self.lock = threading.Lock()
        self.t0 = self.last = time.monotonic()
        self.spoken = False
        """Whether any progress line was printed yet (the heartbeat waits ``QUIET_S`` before the first)."""
        self.activity = ""
        self.steps: list = []
        """[label, start time, announced] of each running step, innermost last."""
        self.stop = threading.Event()

    def __call__(self, text: str) -> None:
        with self.lock:
            self.fn(text)
            self.touch()

    def touch(self) -> None:
        self.last = time.monotonic()
        self.spoken = True

    def due_s(self, now: float) -> float:
        """Seconds until the heartbeat's next line is due (<= 0: now)."""
        if not self.spoken:
            return self.t0 + QUIET_S - now
        return self.last + HEARTBEAT_S - now

    def beat(self) -> None:
        """Print the innermost step's label (and activity and elapsed time once announced)."""
        with self.lock:
            now = time.monotonic()
            if self.due_s(now) > 0 or self.stop.is_set():
                return
            if not self.steps:
                self.fn(f"working ({now - self.t0:.0f} s)")
            else:
                entry = self.steps[-1]
                label, t0, announced = entry
                if not announced:
                    self.fn(f"{label} ...")
                    entry[2] = True
                else:
                    doing = f": {self.activity}" if self.activity else ""
                    self.fn(f"{label}{doing} ({now - t0:.0f} s)")
            self.touch()

    def run(self) -> None:
        while not self.stop.wait(max(0.0, min(self.due_s(time.monotonic()), HEARTBEAT_S))):
            self.beat()


@contextlib.contextmanager
def reporting(sink):
    """Send progress lines to ``sink(text)`` inside the block, with a heartbeat that never lets
    a command that has run ``QUIET_S`` go ``HEARTBEAT_S`` without a line."""
    s = _Sink(sink)
    token = _SINK.set(s)
    beat = threading.Thread(target=s.run, name="hetplan-progress", daemon=True)
    beat.start()
    try:
        yield
    finally:
        s.stop.set()
        beat.join()
        _SINK.reset(token)


def printed() -> None:
    """The command printed a progress line of its own (a terminal progress bar, exec's layer
    counts): the heartbeat starts counting silence again."""
    sink = _SINK.get()
    if sink is not None:
        with sink.lock:
            sink.touch()


def quiet() -> None:
    """The command's long work is over and from now on it waits by design (``serve`` listening):
    the heartbeat stops (lines the command prints itself still show)."""
    sink = _SINK.get()
    if sink is not None:
        sink.stop.set()


def detach() -> None:
    """In a forked child (``hetplan.pipeline.forked``): no sink, so it never takes the parent's lock,
    which the parent's heartbeat thread may have held at the fork; the parent reports."""
    _SINK.set(None)


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
CANCEL_GRACE_S = 0.2
"""The same inside ``cancellable()``: its blocks write nothing, so ending in the middle of a
native call (a long torch op) loses nothing; the grace only lets Python's own KeyboardInterrupt
win when the call was about to return."""


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
    with _watchdog(Interrupt(), CANCEL_GRACE_S):
        yield


@contextlib.contextmanager
def _watchdog(flag: Interrupt, grace_s: float = GRACE_S):
    """Python sees a signal only when the main thread runs Python again, which a long native call
    delays; a watcher thread learns of SIGINT at once through ``signal.set_wakeup_fd``, sets
    ``flag.requested``, and if the block has not ended ``grace_s`` later, the process exits there
    with code 130 and the CLI's one line. That is safe because the blocks guarded write nothing,
    and every file hetplan writes is renamed into place whole."""
    left = threading.Event()
    sink = _SINK.get()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch():
        while not left.is_set():
            ready, _, _ = select.select([read_fd], [], [], 0.1)
            if ready and signal.SIGINT in os.read(read_fd, 64):
                flag.requested = True
                if sink is not None:  # no progress line after Ctrl-C: the next line is the last
                    sink.stop.set()
                if not left.wait(grace_s):
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
        try:
            os.write(write_fd, b"\0")  # wake the watcher's select now rather than at its next 0.1 s tick
        except BlockingIOError:  # the pipe is full: the watcher has bytes to read already
            pass
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


@contextlib.contextmanager
def step(label: str, long: bool = False):
    """A step: the heartbeat says ``label`` once the command has run ``QUIET_S`` (at once when the
    step is known to be ``long``), then repeats it with its activity and elapsed time whenever
    ``HEARTBEAT_S`` passed without a line. Steps nest; the innermost is the one shown."""
    sink = _SINK.get()
    if sink is None:
        yield
        return
    entry = [label, time.monotonic(), long]
    with sink.lock:
        outer_activity, sink.activity = sink.activity, ""
        sink.steps.append(entry)
    if long:
        sink(f"{label} ...")
    try:
        yield
    finally:
        with sink.lock:
            sink.steps.remove(entry)
            sink.activity = outer_activity
