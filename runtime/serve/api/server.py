"""Run the API with uvicorn: in the foreground (``hetplan serve``) or on a thread, started and
stopped within a test (``running``)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from hetplan.errors import HetplanError
from hetplan.runtime.serve.api.app import make_app


def _config(engine, host: str, port: int, model_name: str) -> uvicorn.Config:
    return uvicorn.Config(make_app(engine, model_name), host=host, port=port, log_level="warning",
                          lifespan="off", timeout_graceful_shutdown=5)


def serve_forever(engine, host: str, port: int, model_name: str) -> None:
    """Serve until interrupted; the engine steps on its own thread meanwhile. An engine that
    breaks (``broken_event``: a served pipeline whose stage failed) stops the server, and its
    ``broken`` line is raised."""
    check_listen(host, port)
    server = uvicorn.Server(_config(engine, host, port, model_name))
    broken = getattr(engine, "broken_event", None)
    if broken is not None:  # a served pipeline whose stage failed: stop serving, say why
        threading.Thread(target=lambda: (broken.wait(), setattr(server, "should_exit", True)),
                         name="hetplan-serve-broken", daemon=True).start()
    engine.start()
    try:
        server.run()
    finally:
        engine.stop()
    if getattr(engine, "broken", None):
        raise HetplanError(engine.broken)


def check_listen(host: str, port: int) -> None:
    """A clear one-line error for an address this process cannot listen on (a port in use),
    before uvicorn's own log lines."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        raise HetplanError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another "
                           f"--port or stop what holds it") from None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def running(engine, model_name: str = "hetplan", host: str = "127.0.0.1", step: bool = True):
    """A server on a free loopback port for the duration of the block: -> its base URL.
    ``step=False``: the engine's thread is left for the caller to ``start`` (requests queue)."""
    port = free_port(host)
    server = uvicorn.Server(_config(engine, host, port, model_name))
    if step:
        engine.start()
    thread = threading.Thread(target=server.run, name="hetplan-serve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            engine.stop()
            raise HetplanError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join()
        engine.stop()
