"""Which connection an HTTP endpoint closes when it is over its connection limit (pure
bookkeeping; the real sockets are in tests/integration/test_http_slowloris.py)."""

from __future__ import annotations

import asyncio
from typing import cast

from aiohttp.web_protocol import RequestHandler

from node_agent.observe.http_ports import OVERFLOW, SILENT_GRACE, HttpEndpoint


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def connect(endpoint: HttpEndpoint) -> tuple[RequestHandler, FakeTransport]:
    handler, transport = cast(RequestHandler, object()), FakeTransport()
    endpoint.opened(handler, cast(asyncio.Transport, transport))
    return handler, transport


async def settle() -> None:
    for _ in range(4):
        await asyncio.sleep(0)


async def test_a_partial_head_goes_before_a_newcomer_that_sent_nothing_yet() -> None:
    """Over the limit, the oldest connection that sent part of a head is closed; one that
    sent nothing yet (a probe whose head was not read in time) is kept."""
    endpoint = HttpEndpoint("health", {}, max_connections=2)
    _, quiet_t = connect(endpoint)  # oldest, nothing read yet
    slow = [connect(endpoint) for _ in range(2)]
    for handler, _ in slow:
        assert endpoint.received(handler, b"GET /healthz HTTP/1.1\r\nX-Slow: ")
    await settle()
    assert endpoint.open_connections == 2
    assert not quiet_t.aborted
    assert sum(t.aborted for _, t in slow) == 1
    assert endpoint.stats.refused == 1
    await endpoint.close()


async def test_with_no_partial_head_the_oldest_silent_one_goes_after_its_grace() -> None:
    """A connection that sent nothing is kept over the limit for SILENT_GRACE (a probe whose
    writer was descheduled after its connect), then the oldest such goes."""
    endpoint = HttpEndpoint("health", {}, max_connections=2)
    conns = [connect(endpoint) for _ in range(3)]
    await settle()
    assert [t.aborted for _, t in conns] == [False, False, False]
    assert endpoint.open_connections == 3
    await asyncio.sleep(SILENT_GRACE + 0.05)
    await settle()
    assert [t.aborted for _, t in conns] == [True, False, False]
    assert endpoint.stats.refused == 1
    await endpoint.close()


async def test_a_silent_connection_whose_head_arrives_in_its_grace_is_served() -> None:
    endpoint = HttpEndpoint("health", {}, max_connections=1)
    held, held_t = connect(endpoint)
    assert endpoint.received(held, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    late, late_t = connect(endpoint)
    await settle()
    await asyncio.sleep(SILENT_GRACE / 2)
    assert endpoint.received(late, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.sleep(SILENT_GRACE)
    await settle()
    assert not held_t.aborted
    assert not late_t.aborted
    assert endpoint.stats.refused == 0
    await endpoint.close()


async def test_with_the_overflow_full_a_silent_one_goes_without_grace() -> None:
    """The descriptor bound holds: at OVERFLOW beyond the limit a newcomer closes the oldest
    judged connection even if it sent nothing, rather than waiting out its grace."""
    endpoint = HttpEndpoint("health", {}, max_connections=1)
    conns = [connect(endpoint) for _ in range(1 + OVERFLOW)]
    await settle()
    assert endpoint.open_connections == 1 + OVERFLOW
    newcomer = connect(endpoint)
    assert conns[0][1].aborted
    assert not newcomer[1].aborted
    assert endpoint.open_connections == 1 + OVERFLOW
    await endpoint.close()


async def test_a_complete_head_is_never_closed_to_make_room() -> None:
    endpoint = HttpEndpoint("health", {}, max_connections=1)
    served, served_t = connect(endpoint)
    assert endpoint.received(served, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    others = [connect(endpoint) for _ in range(2)]
    await settle()
    await asyncio.sleep(SILENT_GRACE + 0.05)
    await settle()
    assert not served_t.aborted
    assert all(t.aborted for _, t in others)
    await endpoint.close()
