"""A scripted API server at the HTTP level, on loopback: the real client talks to it over a socket.

Why at the wire: a fake of the client's methods would skip what the client itself does (the
bearer token re-read from its file, the one retry after a 401, its timeouts, its rebuild when the
kubeconfig changes, cutting a watch stream into events). This server knows no Kubernetes
semantics: a test scripts the answers (``answer``), each request is recorded as it arrived
(``requests``), and anything not scripted is a 404 Status.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Answer:
    """One scripted answer: a status and a JSON body, after ``delay`` seconds; a watch answer
    sends ``chunks`` (raw bytes, cut where the test wants) one after the other instead."""

    status: int = 200
    body: Any = None
    delay: float = 0.0
    chunks: Sequence[bytes] = ()


@dataclass(frozen=True)
class Seen:
    """A request as it arrived."""

    method: str
    path: str
    query: dict[str, str]
    authorization: str
    user_agent: str
    content_type: str
    body: bytes


def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``Status`` document as the API server sends with an error."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "reason": reason,
        "message": message,
        "code": code,
    }


@dataclass
class WireAPIServer:
    """The server; ``url`` once started (``started``)."""

    url: str = ""
    requests: list[Seen] = field(default_factory=list)
    _script: dict[tuple[str, str], deque[Answer]] = field(default_factory=dict)

    def answer(self, method: str, path: str, *answers: Answer) -> None:
        """Answer the next requests for ``method path`` with ``answers``, in order; the last one
        repeats."""
        self._script[(method, path)] = deque(answers)

    def seen(self, method: str, path: str) -> list[Seen]:
        return [r for r in self.requests if (r.method, r.path) == (method, path)]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(
            Seen(
                method=request.method,
                path=request.path,
                query=dict(request.query),
                authorization=request.headers.get("Authorization", ""),
                user_agent=request.headers.get("User-Agent", ""),
                content_type=request.headers.get("Content-Type", ""),
                body=await request.read(),
            )
        )
        queue = self._script.get((request.method, request.path))
        if not queue:
            body = status_body(404, "NotFound", f"{request.path} not found")
            return web.json_response(body, status=404)
        answer = queue.popleft() if len(queue) > 1 else queue[0]
        if answer.delay:
            await asyncio.sleep(answer.delay)
        if answer.chunks:
            stream = web.StreamResponse(status=answer.status)
            stream.content_type = "application/json"
            await stream.prepare(request)
            for chunk in answer.chunks:
                await stream.write(chunk)
                await asyncio.sleep(0)
            await stream.write_eof()
            return stream
        return web.Response(
            status=answer.status,
            body=json.dumps(answer.body if answer.body is not None else {}).encode(),
            content_type="application/json",
        )


@asynccontextmanager
async def started() -> AsyncIterator[WireAPIServer]:
    """A ``WireAPIServer`` listening on a free loopback port for the block's duration."""
    server = WireAPIServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server._handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    server.url = f"http://127.0.0.1:{port}"
    try:
        yield server
    finally:
        await runner.cleanup()
