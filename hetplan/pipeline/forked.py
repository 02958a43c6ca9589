"""Independent pure computations on several cores: ``forked_map(fn, items)`` is
``[fn(x) for x in items]``, the items shared between this process and forked children.

The search over pipeline stages prices several stages at a time (each a MILP and a replay, a
few tenths of a second); each is a pure function of its inputs, so running them side by side
changes only how long the search takes, never what it finds. Fork (not spawn) because a child
starts in milliseconds with everything this process has built (problems, bounds, imports), and
hands back its results pickled through a pipe: bytes from a child of this process, never read
from a file. The child does not collect garbage (its collector would write to, so copy, every
page it shares with this process). A child that dies or cannot send its results costs only time: its items are
computed again here. An exception a child raises is raised here. ``HETPLAN_JOBS`` sets how many
processes run at once (default: the CPUs this process may run on; 1: no child).
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import time
from typing import Callable

from hetplan.env import count


def jobs() -> int:
    """Processes ``forked_map`` runs at once: ``HETPLAN_JOBS``, else the CPUs this process may
    run on."""
    default = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return count("HETPLAN_JOBS", default)


def cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of the children it has waited for (those of
    ``forked_map``): what a computation that forks costs, measured as a difference."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def forked_map(fn: Callable, items: list, n_jobs: int | None = None) -> list:
    """``[fn(x) for x in items]``, in up to ``n_jobs`` processes (this one and forked children;
    default ``jobs()``). ``fn`` must be pure: what a child changes in its memory is lost."""
    items = list(items)
    n = min(n_jobs or jobs(), len(items))
    if n <= 1 or not hasattr(os, "fork"):
        return [fn(x) for x in items]
    groups = [list(range(i, len(items), n)) for i in range(n)]
    children = [(_fork(fn, [items[i] for i in g]), g) for g in groups[1:]]
    results: list = [None] * len(items)
    try:
        for i in groups[0]:
            results[i] = fn(items[i])
        for child, group in children:
            outcome = _collect(child)
            if outcome is None:   # the child died or could not send: compute its items here
                outcome = ("ok", [fn(items[i]) for i in group])
            status, value = outcome
            if status == "err":
                raise value
            for i, r in zip(group, value):
                results[i] = r
    finally:
        for child, _ in children:
            _reap(child)
    return results


def _fork(fn: Callable, items: list) -> tuple:
    """Fork a child computing ``[fn(x) for x in items]`` -> (pid, read end of its pipe)."""
    read, write = os.pipe()
    gc.freeze()   # the child's collector would touch, so copy, every page this process has
    pid = os.fork()
    if pid:
        gc.unfreeze()
        os.close(write)
        return [pid, read]
    gc.disable()   # the child: short-lived, and never returns
    os.close(read)
    try:
        from hetplan import progress

        progress.detach()   # the parent's heartbeat thread and its lock did not come along
        try:
            data = pickle.dumps(("ok", [fn(x) for x in items]))
        except BaseException as e:  # noqa: BLE001 -- every failure goes back to the parent
            try:
                data = pickle.dumps(("err", e))
            except Exception:  # noqa: BLE001 -- an exception that does not pickle: its text
                data = pickle.dumps(("err", RuntimeError(f"{type(e).__name__}: {e}")))
        view = memoryview(data)
        while view:
            view = view[os.write(write, view):]
    finally:
        os._exit(0)


def _collect(child: list):
    """The child's (status, value), or None when it sent nothing whole; the child waited for."""
    pid, fd = child
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    child[1] = None
    os.waitpid(pid, 0)
    try:
        return pickle.loads(b"".join(chunks)) if chunks else None
    except Exception:  # noqa: BLE001 -- a truncated message: the child died mid-write
        return None


def _reap(child: list) -> None:
    """A child not collected (the parent failed first): close its pipe, kill it, wait for it."""
    pid, fd = child
    if fd is None:
        return
    os.close(fd)
    child[1] = None
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
