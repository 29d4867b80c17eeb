"""The health probe and metrics ports: GET-only HTTP on ``aiohttp.web``'s server, bounded in
every way a client could abuse.

Both bind where Gardener's config says (``server.healthProbes`` / ``server.metrics``:
``bindAddress`` '' = every address, like upstream's ``net.JoinHostPort("", port)``; port 0 picks a
free port, see :attr:`HttpEndpoint.port`). Listening on every address means anyone who reaches the
node may connect, so each endpoint bounds what a client can hold: :data:`MAX_CONNECTIONS`
connections (for two turns of the event loop up to :data:`OVERFLOW` more, see
:class:`HttpEndpoint`), a request head within :data:`HEAD_TIMEOUT` and :data:`MAX_HEADER_BYTES`,
the exchange within :data:`EXCHANGE_TIMEOUT`, one request per connection.

aiohttp parses HTTP and writes the answers; the connection bounds are the agent's own (aiohttp
has none for a connection that never sends its request): :class:`_BoundedServer` reports every
connection to its :class:`HttpEndpoint`, which closes what exceeds a bound and counts it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from node_agent.base.log import get_logger
from node_agent.observe.view import EndpointView

log = get_logger("node-agent.observability")

#: Connections one endpoint holds at once (the kubelet's probes and a scrape need one or two).
MAX_CONNECTIONS = 16
#: Connections accepted per turn of the event loop.
ACCEPT_BACKLOG = 32
#: Connections the kernel queues until the agent accepts them (they hold no agent descriptor):
#: deep enough that a flood of reconnecting clients does not overflow it and drop a probe's SYN
#: (a dropped SYN is sent again after 1 s, the kubelet's whole probe timeout).
LISTEN_BACKLOG = 1024
#: Connections held beyond the limit while they settle: a new connection is judged only after two
#: turns of the event loop, when what it sent has been read (a probe, which sends its request at
#: once, is then being served and is never closed to make room). Three turns of accepts.
OVERFLOW = 3 * ACCEPT_BACKLOG
#: A connection that has sent nothing yet is closed to make room only once it is this old, or when
#: the endpoint holds ``OVERFLOW`` connections beyond its limit: a kubelet descheduled between its
#: connect and its write on a busy host is a probe, not an idle client (a slow client shows itself
#: with its first bytes and goes after two loop turns).
SILENT_GRACE = 0.25
#: Deadlines for a request head and for a whole exchange (head, answer, sending it).
HEAD_TIMEOUT = 3.0
EXCHANGE_TIMEOUT = 10.0
#: A request head larger than this is answered 431 (probes and scrapes send a few hundred bytes);
#: at most :data:`MAX_HEADERS` header lines.
MAX_HEADER_BYTES = 8 * 1024
MAX_HEADERS = 32
_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain\r\n"
    b"Content-Length: 23\r\nConnection: close\r\n\r\nrequest head too large\n"
)
#: At most one warning about connections closed at the limit per this many seconds.
REFUSED_WARNING_INTERVAL = 60.0

#: aiohttp's own log of requests it could not parse (a traceback each): a client's error, not the
#: agent's, and a flood of them must not flood the journal.
_AIOHTTP_LOG = logging.getLogger("node_agent.observe.http_ports.aiohttp")
_AIOHTTP_LOG.addHandler(logging.NullHandler())
_AIOHTTP_LOG.propagate = False

#: A route's answer: status, content type, body.
Handler = Callable[[], Awaitable[tuple[int, str, str]]]


@dataclass
class EndpointStats:
    """What an endpoint did with its connections (exported as metrics, never logged one by one)."""

    accepted: int = 0
    #: closed unserved at the connection limit: the oldest idle one, or the new one
    refused: int = 0
    #: closed because the request head or the whole exchange missed its deadline
    timed_out: int = 0


@dataclass
class _Connection:
    transport: asyncio.BaseTransport
    made_turn: int = 0  # the endpoint's loop turn when it was made
    made_at: float = 0.0  # the loop's clock when it was made
    reading: bool = True  # no request head yet
    head_bytes: int = 0  # received while reading
    tail: bytes = b""  # the last bytes received while reading (the head's end may be split)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)

    def abort(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.transport.abort()  # type: ignore[attr-defined]


class _BoundedHandler(RequestHandler):
    """aiohttp's protocol for one connection; what arrives before the request head is complete
    is counted first (aiohttp bounds single header lines, not a head sent in many pieces)."""

    def __init__(self, manager: web.Server, endpoint: HttpEndpoint, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._bounded_by = endpoint

    def data_received(self, data: bytes) -> None:
        if self._bounded_by.received(self, data):
            super().data_received(data)


class _BoundedServer(web.Server):
    """aiohttp's low-level server, telling its endpoint of every connection made and lost."""

    def __init__(self, endpoint: HttpEndpoint, **kwargs: Any) -> None:
        super().__init__(endpoint.dispatch, **kwargs)
        self._endpoint = endpoint
        self._handler_options = kwargs

    def __call__(self) -> RequestHandler:
        loop = asyncio.get_running_loop()
        return _BoundedHandler(self, self._endpoint, loop=loop, **self._handler_options)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._endpoint.opened(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._endpoint.closed(handler)


class HttpEndpoint:
    """GET/HEAD only, one request per connection, bounded in every way a client could abuse.

    At most ``max_connections`` connections are held at once. A connection beyond the limit is
    judged two turns of the event loop after it was made, when what it sent has been read: then
    the oldest connections still sending their request head are closed until the limit holds (an
    idle or slow client gives way to a probe, whose complete head was read meanwhile; one that
    sent part of a head goes before one that sent nothing yet, and one that sent nothing is
    judged only after :data:`SILENT_GRACE`: a probe's writer may be descheduled for a moment after
    its connect on a busy host). Judging
    on arrival instead closed a probe accepted in the same burst as a flood of newcomers before
    its request was ever read. With :data:`OVERFLOW` connections beyond the limit, a newcomer
    closes the oldest head-sending connection already judged, or is closed itself. A request head
    must arrive within ``head_timeout`` and be at most :data:`MAX_HEADER_BYTES`; the whole
    exchange ends within ``exchange_timeout``. So an idle or slow flood costs at most
    ``max_connections`` descriptors (``OVERFLOW`` more while they settle) and never starves
    the kubelet's probes.
    """

    def __init__(
        self,
        name: str,
        routes: Mapping[str, Handler],
        *,
        serves: tuple[str, ...] = (),
        max_connections: int = MAX_CONNECTIONS,
        head_timeout: float = HEAD_TIMEOUT,
        exchange_timeout: float = EXCHANGE_TIMEOUT,
    ) -> None:
        self.name = name
        self.routes = dict(routes)
        self.serves = serves or (name,)
        self.max_connections = max_connections
        self.head_timeout = head_timeout
        self.exchange_timeout = exchange_timeout
        self.stats = EndpointStats()
        self._runner: web.ServerRunner | None = None
        #: Open connections, oldest first.
        self._connections: dict[RequestHandler, _Connection] = {}
        self._warned_at: float | None = None
        self._refused_at_warning = 0
        self._turn = 0  # loop turns counted while connections beyond the limit settle
        self._ticking = False
        self._grace_timer: asyncio.TimerHandle | None = None

    async def start(self, bind_address: str, port: int) -> None:
        server = _BoundedServer(
            self,
            access_log=None,
            logger=_AIOHTTP_LOG,
            max_line_size=MAX_HEADER_BYTES,
            max_field_size=MAX_HEADER_BYTES,
            max_headers=MAX_HEADERS,
            lingering_time=1.0,
        )
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        host = bind_address or None  # '' = every address, as upstream
        site = web.TCPSite(runner, host, port, backlog=ACCEPT_BACKLOG)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        # asyncio listens with the per-turn accept count as the kernel's queue; deepen the queue
        # (the sockets are aiohttp's site's, not otherwise reachable)
        for sock in getattr(getattr(site, "_server", None), "sockets", ()):
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                dup.listen(LISTEN_BACKLOG)
        self._runner = runner

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        assert self._runner is not None
        return int(self._runner.addresses[0][1])

    @property
    def address(self) -> str:
        """``host:port`` of the first bound socket (IPv6 hosts in brackets)."""
        assert self._runner is not None
        host = str(self._runner.addresses[0][0])
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def view(self) -> EndpointView:
        """What the read side shows of this endpoint."""
        address = self.address if self._runner is not None else None
        return EndpointView(
            self.name, address, self.stats.refused, self.stats.timed_out, self.serves
        )

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        for connection in self._connections.values():
            connection.abort()
        self._connections.clear()
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        try:
            async with asyncio.timeout(2.0):
                await runner.cleanup()
        except TimeoutError:
            log.warning("http endpoint not closed in time", endpoint=self.name)

    # -- connections (called by _BoundedServer) ------------------------------------------------

    def opened(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self.stats.accepted += 1
        loop = asyncio.get_running_loop()
        if len(self._connections) >= self.max_connections + OVERFLOW and not self._make_room(
            full=True
        ):
            transport.abort()
            self._refused()
            return
        connection = _Connection(transport, made_turn=self._turn, made_at=loop.time())
        connection.timers = [
            loop.call_later(self.head_timeout, self._expire, handler, True),
            loop.call_later(self.exchange_timeout, self._expire, handler, False),
        ]
        self._connections[handler] = connection
        if len(self._connections) > self.max_connections:
            self._tick_soon()

    def _tick_soon(self) -> None:
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        """One turn of the loop: close judged head-sending connections, oldest first, until at
        most the limit are held; turn again while newer ones beyond it still settle."""
        self._ticking = False
        self._turn += 1
        while len(self._connections) > self.max_connections and self._make_room(full=False):
            pass
        if len(self._connections) <= self.max_connections:
            return
        reading = [c for c in self._connections.values() if c.reading]
        if any(c.made_turn > self._turn - 2 for c in reading):
            self._tick_soon()
        elif reading and self._grace_timer is None:
            # only silent connections within their grace are left: judge them when it ends
            loop = asyncio.get_running_loop()
            wait = max(0.0, min(c.made_at for c in reading) + SILENT_GRACE - loop.time())
            self._grace_timer = loop.call_later(wait, self._grace_ended)

    def _grace_ended(self) -> None:
        self._grace_timer = None
        self._tick_soon()

    def received(self, handler: RequestHandler, data: bytes) -> bool:
        """Bytes arrived on a connection: False (and the connection answered 431 and closed) if
        its request head grew beyond :data:`MAX_HEADER_BYTES`. A complete head makes the
        connection a served one at once (it is no longer closed to make room)."""
        connection = self._connections.get(handler)
        if connection is None:
            return False  # closed by the agent meanwhile
        if not connection.reading:
            return True
        connection.head_bytes += len(data)
        if connection.head_bytes <= MAX_HEADER_BYTES:
            if b"\r\n\r\n" in connection.tail + data:
                connection.reading = False
            connection.tail = (connection.tail + data)[-3:]
            return True
        del self._connections[handler]
        for timer in connection.timers:
            timer.cancel()
        connection.transport.write(_TOO_LARGE)  # type: ignore[attr-defined]
        connection.transport.close()
        return False

    def closed(self, handler: RequestHandler) -> None:
        connection = self._connections.pop(handler, None)
        if connection is not None:
            for timer in connection.timers:
                timer.cancel()

    def _expire(self, handler: RequestHandler, head_only: bool) -> None:
        connection = self._connections.get(handler)
        if connection is None or (head_only and not connection.reading):
            return
        del self._connections[handler]
        self.stats.timed_out += 1
        connection.abort()

    def _make_room(self, *, full: bool) -> bool:
        """Close the oldest connection still reading its head that was made at least two loop
        turns ago (so what it sent has been read); False if there is none. One that sent part
        of a head goes before one that sent nothing yet: a probe sends its whole head in one
        piece, but on a busy host it may not have been read within two turns, while a slow
        client has shown what it is. One that sent nothing is judged only after
        :data:`SILENT_GRACE`, unless the endpoint is ``full`` (``OVERFLOW`` beyond its limit)."""
        silent_before = asyncio.get_running_loop().time() - SILENT_GRACE
        judged = [
            handler
            for handler, connection in self._connections.items()
            if connection.reading
            and connection.made_turn <= self._turn - 2
            and (full or connection.head_bytes or connection.made_at <= silent_before)
        ]
        if not judged:
            return False
        victim = next((h for h in judged if self._connections[h].head_bytes), judged[0])
        connection = self._connections.pop(victim)
        connection.abort()
        self._refused()
        return True

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

    # -- requests ----------------------------------------------------------------------------

    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        """One request (its head has arrived): the route's answer, ``Connection: close``."""
        connection = self._connections.get(request.protocol)
        if connection is not None:
            connection.reading = False  # serving: no longer idle
        if request.method not in ("GET", "HEAD"):
            status, ctype, body = 405, "text/plain", "method not allowed\n"
        elif (route := self.routes.get(request.path)) is None:
            status, ctype, body = 404, "text/plain", "not found\n"
        else:
            try:
                status, ctype, body = await route()
            except Exception as exc:  # a bug in a handler must not kill the server
                log.warning("http handler failed", endpoint=self.name, error=str(exc))
                status, ctype, body = 500, "text/plain", "internal error\n"
        response = web.Response(status=status, body=body.encode(), headers={"Content-Type": ctype})
        response.force_close()
        return response
