"""The probe port under a slowloris flood on loopback: hundreds of clients that each send a
request head a byte at a time and reconnect the moment they are closed. The kubelet's probe
(a 1 s timeout, as the kubelet's default) must keep answering. Bounded: 600 connections from a
child process, 45 probes, about 8 s."""

from __future__ import annotations

import asyncio
import sys

import pytest

from node_agent.observe.http_ports import OVERFLOW, HttpEndpoint

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


#: One kubelet-like probe per line read: "ok" if it answered 200 within the timeout, else why not.
#: Its own process, as the kubelet is: a thread of the test would share the endpoint's interpreter
#: lock and could be held between its connect and its write for many turns of the endpoint's loop.
PROBER = r"""
import socket, sys, time
port, timeout = int(sys.argv[1]), float(sys.argv[2])
for _ in sys.stdin:
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(max(0.01, timeout - (time.monotonic() - started)))
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while b"\r\n" not in answer:
                chunk = sock.recv(256)
                if not chunk:
                    break
                answer += chunk
    except OSError as exc:
        print(f"{type(exc).__name__}: {exc} after {time.monotonic() - started:.2f}s", flush=True)
        continue
    print("ok" if answer.startswith(b"HTTP/1.1 200") else f"answer {answer[:40]!r}", flush=True)
"""


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
    probers: list[asyncio.subprocess.Process | None] = [None]
    try:
        assert flood.stdout is not None
        assert await asyncio.wait_for(flood.stdout.readline(), 20) == b"flooding\n"
        await asyncio.sleep(1.0)  # the flood at full strength
        prober = probers[0] = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PROBER,
            str(endpoint.port),
            str(PROBE_TIMEOUT),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert prober.stdin is not None
        assert prober.stdout is not None
        failures = []
        for _ in range(PROBES):
            prober.stdin.write(b"probe\n")
            await prober.stdin.drain()
            answer = (await asyncio.wait_for(prober.stdout.readline(), 10)).decode().strip()
            if answer != "ok":
                failures.append(answer)
            await asyncio.sleep(0.1)
        prober.stdin.close()
        await prober.wait()
        assert endpoint.open_connections <= endpoint.max_connections + OVERFLOW
        print(
            f"{PROBES} probes under {CLIENTS} slowloris clients: {len(failures)} failed; "
            f"accepted {endpoint.stats.accepted}, refused {endpoint.stats.refused}, "
            f"timed out {endpoint.stats.timed_out}"
        )
        assert failures == []
    finally:
        for child in (flood, probers[0]):
            if child is not None and child.returncode is None:
                child.kill()
            if child is not None:
                await child.wait()
        await endpoint.close()
