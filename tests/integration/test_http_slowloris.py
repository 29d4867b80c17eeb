"""The probe port under a slowloris flood on loopback: hundreds of clients that each send a
request head a byte at a time and reconnect the moment they are closed. The kubelet's probe
(a 1 s timeout, as the kubelet's default) must keep answering. Bounded: 600 connections from a
child process, 45 probes, about 8 s."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import pytest

from node_agent.observe.http_ports import HttpEndpoint

pytestmark = pytest.mark.integration

CLIENTS = 600
PROBES = 45
PROBE_TIMEOUT = 1.0

#: CLIENTS slowloris clients against a port for a while; each reconnects when closed.
FLOOD = r"""
import asyncio, sys
port, clients, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])

async def client(stop):
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            while not stop.is_set():
                await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                        break  # closed by the server: come back at once
                except asyncio.TimeoutError:
                    writer.write(b"a")
        except OSError:
            pass
        finally:
            writer.close()

async def main():
    stop = asyncio.Event()
    tasks = [asyncio.create_task(client(stop)) for _ in range(clients)]
    print("flooding", flush=True)
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait(tasks, timeout=5)

asyncio.run(main())
"""


def _probe(port: int) -> str | None:
    """One kubelet-like probe: None if it answered 200 within the timeout, else why not."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT) as sock:
            sock.settimeout(max(0.01, PROBE_TIMEOUT - (time.monotonic() - started)))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while b"\r\n" not in answer:
                chunk = sock.recv(256)
                if not chunk:
                    break
                answer += chunk
    except OSError as exc:
        return f"{type(exc).__name__}: {exc} after {time.monotonic() - started:.2f}s"
    if not answer.startswith(b"HTTP/1.1 200"):
        return f"answer {answer[:40]!r}"
    return None


@pytest.mark.timeout(60)
async def test_healthz_keeps_answering_under_a_slowloris_flood() -> None:
    async def ok() -> tuple[int, str, str]:
        return 200, "text/plain", "ok\n"

    endpoint = HttpEndpoint("health", {"/healthz": ok})
    await endpoint.start("127.0.0.1", 0)
    flood = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        FLOOD,
        str(endpoint.port),
        str(CLIENTS),
        "10",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert flood.stdout is not None
        assert await asyncio.wait_for(flood.stdout.readline(), 20) == b"flooding\n"
        await asyncio.sleep(1.0)  # the flood at full strength
        failures = []
        for _ in range(PROBES):
            why = await asyncio.to_thread(_probe, endpoint.port)
            if why is not None:
                failures.append(why)
            await asyncio.sleep(0.1)
        assert endpoint.open_connections <= 4 * endpoint.max_connections
        print(
            f"{PROBES} probes under {CLIENTS} slowloris clients: {len(failures)} failed; "
            f"accepted {endpoint.stats.accepted}, refused {endpoint.stats.refused}, "
            f"timed out {endpoint.stats.timed_out}"
        )
        assert failures == []
    finally:
        if flood.returncode is None:
            flood.kill()
        await flood.wait()
        await endpoint.close()
