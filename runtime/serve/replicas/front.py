"""The front of a served plan with replicas: one HTTP server dealing each request to a replica's
own server (an internal address), the one with the fewest requests in flight (least
outstanding; the lowest index on a tie).

- ``/v1/completions`` and ``/v1/chat/completions`` are forwarded as they come (body and content
  type); the replica's answer comes back as it is, a streamed one (server-sent events) chunk by
  chunk. A replica that cannot be reached or that breaks off mid-answer ends that request with
  an OpenAI error body (HTTP 502, or an error event and ``[DONE]`` mid-stream).
- ``/v1/models``: replica 0's answer (every replica serves the same model).
- ``/health``: ``{"status": "ok"}`` when every replica answers its own ``/health`` with 200,
  else 503 saying which do not.
- ``/metrics``: each sample of the replicas' Prometheus text summed over them (counters, gauges,
  histogram buckets alike), then each replica's own with a ``replica="r"`` label; and the
  front's ``hetplan_replica_requests_total`` / ``hetplan_replica_requests_in_flight`` per replica.

Knows nothing about engines, tensors or processes: only the replicas' base URLs.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

HEALTH_TIMEOUT_S = 5.0
"""How long ``/health`` and ``/metrics`` wait for each replica's own answer."""


class Front:
    def __init__(self, urls: list):
        self.urls = list(urls)
        self.in_flight = [0] * len(urls)
        self.dealt = [0] * len(urls)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None))

    def pick(self) -> int:
        """The replica with the fewest requests in flight (the lowest index on a tie)."""
        return min(range(len(self.urls)), key=lambda i: (self.in_flight[i], i))

    async def forward(self, request: Request):
        body = await request.body()
        i = self.pick()
        self.in_flight[i] += 1
        self.dealt[i] += 1
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        try:
            upstream = await self.client.send(
                self.client.build_request("POST", self.urls[i] + request.url.path, content=body, headers=headers),
                stream=True)
        except httpx.TransportError as e:
            self.in_flight[i] -= 1
            return _failed(i, e)
        kind = upstream.headers.get("content-type", "")
        if kind.startswith("text/event-stream"):
            async def close():   # closing the replica's stream cancels the request there
                await upstream.aclose()
                self.in_flight[i] -= 1
            return _Relayed(self._relay(i, upstream), close, status_code=upstream.status_code, media_type=kind)
        try:
            content = await upstream.aread()
        except httpx.TransportError as e:
            return _failed(i, e)
        finally:
            await upstream.aclose()
            self.in_flight[i] -= 1
        return Response(content, status_code=upstream.status_code, media_type=kind or None)

    async def _relay(self, i: int, upstream: httpx.Response):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            yield _sse(_error_body(i, e))
            yield "data: [DONE]\n\n"


    async def models(self, request: Request):
        try:
            r = await self.client.get(self.urls[0] + "/v1/models", timeout=HEALTH_TIMEOUT_S)
        except httpx.TransportError as e:
            return _failed(0, e)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def _each(self, path: str) -> list:
        """Every replica's answer to GET ``path`` (None for one that does not answer)."""
        async def one(url):
            try:
                return await self.client.get(url + path, timeout=HEALTH_TIMEOUT_S)
            except httpx.TransportError:
                return None
        return await asyncio.gather(*(one(u) for u in self.urls))

    async def health(self, request: Request):
        answers = await self._each("/health")
        down = [i for i, r in enumerate(answers) if r is None or r.status_code != 200]
        if down:
            return JSONResponse({"status": "unavailable", "replicas_down": down}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request):
        answers = await self._each("/metrics")
        texts = [r.text if r is not None and r.status_code == 200 else "" for r in answers]
        own = ["# TYPE hetplan_replica_requests_total counter"]
        own += [f'hetplan_replica_requests_total{{replica="{i}"}} {n}' for i, n in enumerate(self.dealt)]
        own.append("# TYPE hetplan_replica_requests_in_flight gauge")
        own += [f'hetplan_replica_requests_in_flight{{replica="{i}"}} {n}' for i, n in enumerate(self.in_flight)]
        return PlainTextResponse(summed_metrics(texts) + "\n".join(own) + "\n",
                                 media_type="text/plain; version=0.0.4")


class _Relayed(StreamingResponse):
    """A replica's streamed answer, relayed; ``close`` (closing the replica's stream and counting
    the request out) runs once when the response ends, however it ends: a generator's own
    ``finally`` would not run when the client left before the first chunk."""

    def __init__(self, content, close, **kw):
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def summed_metrics(texts: list) -> str:
    """Prometheus text of several replicas -> each sample summed over them, in first-seen order
    (its ``# TYPE`` line before it), then every replica's samples with ``replica="r"`` added."""
    types, order, total, each = {}, [], {}, []
    for r, text in enumerate(texts):
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                types.setdefault(line.split()[2], line)
                continue
            if not line or line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            if key not in total:
                order.append(key)
                total[key] = 0.0
            total[key] += float(value)
            each.append((_name(key), _labelled(key, r), value))
    lines, typed = [], set()
    for key in order:
        name = _name(key)
        family = _family(name, types)
        if family not in typed:
            typed.add(family)
            lines.append(types[family])
        v = total[key]
        lines.append(f"{key} {int(v) if v.is_integer() else v}")
    lines += [f"{key} {value}" for _, key, value in each]
    return "\n".join(lines) + "\n" if lines else ""


def _name(key: str) -> str:
    return key.partition("{")[0]


def _family(name: str, types: dict) -> str:
    """The ``# TYPE`` name a sample belongs to (a histogram's ``_bucket``, ``_sum``, ``_count``)."""
    if name in types:
        return name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in types:
            return name.removesuffix(suffix)
    types[name] = f"# TYPE {name} untyped"
    return name


def _labelled(key: str, r: int) -> str:
    if key.endswith("}"):
        return f'{key[:-1]},replica="{r}"}}'
    return f'{key}{{replica="{r}"}}'


def _error_body(i: int, e: Exception) -> dict:
    return {"error": {"message": f"replica {i}, which served this request, failed: {type(e).__name__}: {e}",
                      "type": "server_error", "param": None, "code": 502}}


def _failed(i: int, e: Exception) -> JSONResponse:
    return JSONResponse(_error_body(i, e), status_code=502)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_front(urls: list) -> tuple:
    """-> (the Starlette app forwarding to the replicas at ``urls``, its ``Front``)."""
    front = Front(urls)
    routes = [Route("/v1/completions", front.forward, methods=["POST"]),
              Route("/v1/chat/completions", front.forward, methods=["POST"]),
              Route("/v1/models", front.models, methods=["GET"]),
              Route("/health", front.health, methods=["GET"]),
              Route("/metrics", front.metrics, methods=["GET"])]
    return Starlette(routes=routes), front
