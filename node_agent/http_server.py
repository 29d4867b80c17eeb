"""The health probe and metrics ports: GET-only HTTP, bounded in every way a client could abuse.

Both bind where Gardener's config says (``server.healthProbes`` / ``server.metrics``:
``bindAddress`` '' = every address, like upstream's ``net.JoinHostPort("", port)``; port 0 picks a
free port, see :attr:`HttpEndpoint.port`). Listening on every address means anyone who reaches the
node may connect, so each endpoint bounds what a client can hold: :data:`MAX_CONNECTIONS`
connections, a request head within :data:`HEAD_TIMEOUT` and :data:`MAX_HEADER_BYTES`, the exchange
within :data:`EXCHANGE_TIMEOUT`, one request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from node_agent.log import get_logger
from node_agent.view import EndpointView

log = get_logger("node-agent.observability")

#: Connections one endpoint holds at once (the kubelet's probes and a scrape need one or two).
MAX_CONNECTIONS = 16
#: Connections the kernel queues until the agent accepts them (they hold no agent descriptor).
ACCEPT_BACKLOG = 64
#: Deadlines for a request head and for a whole exchange (head, answer, sending it).
HEAD_TIMEOUT = 3.0
EXCHANGE_TIMEOUT = 10.0
#: A request head larger than this is answered 431 (probes and scrapes send a few hundred bytes).
MAX_HEADER_BYTES = 8 * 1024
#: At most one warning about connections closed at the limit per this many seconds.
REFUSED_WARNING_INTERVAL = 60.0


Handler = Callable[[], Awaitable[tuple[int, str, str]]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}
_REASONS[431] = "Request Header Fields Too Large"
_REASONS[500] = "Internal Server Error"
_REASONS[503] = "Service Unavailable"


@dataclass
class EndpointStats:
    """What an endpoint did with its connections (exported as metrics, never logged one by one)."""

    accepted: int = 0
    #: closed unserved at the connection limit: the oldest idle one, or the new one
    refused: int = 0
    #: closed because the request head or the whole exchange missed its deadline
    timed_out: int = 0


class HttpEndpoint:
    """GET/HEAD only, one request per connection, bounded in every way a client could abuse.

    At most ``max_connections`` connections are held at once. When a new one arrives at the
    limit, the oldest connection still sending its request head is closed to make room (an idle
    client gives way to a probe); if every slot is serving a request, the new one is closed. A
    request head must arrive within ``head_timeout`` and be at most :data:`MAX_HEADER_BYTES`; the
    whole exchange ends within ``exchange_timeout``. So an idle or slow flood costs at most
    ``max_connections`` descriptors and never starves the kubelet's probes.
    """

    def __init__(
        self,
        name: str,
        routes: Mapping[str, Handler],
        *,
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = HEAD_TIMEOUT,
        exchange_timeout: float = EXCHANGE_TIMEOUT,
    ) -> None:
        self.name = name
        self.routes = dict(routes)
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.exchange_timeout = exchange_timeout
        self.stats = EndpointStats()
        self._server: asyncio.Server | None = None
        #: Open connections, oldest first; True while the request head is still being read.
        self._connections: dict[asyncio.StreamWriter, bool] = {}
        self._warned_at: float | None = None
        self._refused_at_warning = 0

    async def start(self, bind_address: str, port: int) -> None:
        host = bind_address or None  # '' = every address, as upstream
        self._server = await asyncio.start_server(
            self._handle, host=host, port=port, limit=MAX_HEADER_BYTES, backlog=ACCEPT_BACKLOG
        )

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        """``host:port`` of the first bound socket (IPv6 hosts in brackets)."""
        assert self._server is not None
        host = str(self._server.sockets[0].getsockname()[0])
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def view(self, serves: tuple[str, ...] = ()) -> EndpointView:
        """What the read side shows of this endpoint."""
        address = self.address if self._server is not None else None
        return EndpointView(
            self.name, address, self.stats.refused, self.stats.timed_out, serves or (self.name,)
        )

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await self._server.wait_closed()
            self._server = None

    def _make_room(self) -> bool:
        """At the limit: close the oldest connection still reading its head; False if none."""
        for writer, reading in self._connections.items():
            if reading:
                del self._connections[writer]
                writer.transport.abort()
                self._refused()
                return True
        return False

    def _refused(self) -> None:
        """Count a connection closed at the limit; warn at most once per interval."""
        self.stats.refused += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= REFUSED_WARNING_INTERVAL:
            log.warning(
                "connections closed at the connection limit",
                endpoint=self.name,
                limit=self.max_connections,
                closed=self.stats.refused - self._refused_at_warning,
                next_warning_in_seconds=REFUSED_WARNING_INTERVAL,
            )
            self._warned_at = now
            self._refused_at_warning = self.stats.refused

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        if len(self._connections) >= self.max_connections and not self._make_room():
            writer.transport.abort()
            self._refused()
            return
        self._connections[writer] = True
        try:
            async with asyncio.timeout(self.exchange_timeout):
                await self._exchange(reader, writer)
                writer.close()
                await writer.wait_closed()
        except TimeoutError:
            self.stats.timed_out += 1
        except OSError:
            pass  # the client went away
        except Exception as exc:  # never let one connection hurt the agent
            log.warning("http connection failed", endpoint=self.name, error=str(exc))
        finally:
            self._connections.pop(writer, None)
            writer.transport.abort()  # frees the descriptor now (a no-op once closed)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer: tuple[int, str, str, str] | None = None
        try:
            async with asyncio.timeout(self.head_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            head = b""
            answer = (431, "text/plain", "request head too large\n", "GET")
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return  # closed without a word (or made room for another)
            answer = (400, "text/plain", "bad request\n", "GET")
        if writer not in self._connections:
            return  # closed to make room for another connection
        self._connections[writer] = False  # serving: no longer idle
        if answer is None:
            try:
                answer = await self._answer(head)
            except Exception as exc:  # a bug in a handler must not kill the server
                log.warning("http handler failed", endpoint=self.name, error=str(exc))
                answer = (500, "text/plain", "internal error\n", "GET")
        status, ctype, body, method = answer
        data = body.encode()
        header = (
            f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.write(header if method == "HEAD" else header + data)
        await writer.drain()

    async def _answer(self, head: bytes) -> tuple[int, str, str, str]:
        if len(head) > MAX_HEADER_BYTES:
            return 431, "text/plain", "request head too large\n", "GET"
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3:
            return 400, "text/plain", "bad request\n", "GET"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", "method not allowed\n", "GET"
        handler = self.routes.get(target)
        if handler is None:
            return 404, "text/plain", "not found\n", method
        status, ctype, body = await handler()
        return status, ctype, body, method
