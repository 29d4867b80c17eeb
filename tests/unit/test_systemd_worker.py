"""The worker's request handling and job bookkeeping, against a scripted fake bus (no systemd).

The real bus is covered by tests/integration/test_systemd_adapter.py; these pin down orderings
that are hard to provoke there: a JobRemoved that arrives before the job is claimed, a job that
never finishes, systemd refusing to enable an alias name.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from node_agent.systemd.worker import Worker


class DBusBaseError(Exception):
    """Shaped like pystemd's error (the worker recognises it by class name)."""

    def __init__(self, errno: int, err_name: bytes, err_message: bytes) -> None:
        super().__init__(err_message)
        self.errno = errno
        self.err_name = err_name
        self.err_message = err_message


class DBusNoSuchUnitError(DBusBaseError):
    pass


class Reply:
    def __init__(self, body: Any) -> None:
        self.body = body

    def is_empty(self) -> bool:
        return self.body is None

    def process_reply(self, with_headers: bool) -> None:
        pass


class FakeBus:
    """Answers Manager calls from a script; JobRemoved signals are queued or fired at once."""

    def __init__(self) -> None:
        self.callback: Callable[..., None] | None = None
        self.calls: list[tuple[bytes, list[Any]]] = []
        self.queue: list[Reply] = []
        self.handlers: dict[bytes, Callable[[list[Any]], Any]] = {}
        self.props: dict[tuple[bytes, bytes], Any] = {}
        self.next_job = 1

    def match_signal(self, *args: Any) -> None:
        self.callback = args[4]

    def call_method(
        self, dest: bytes, path: bytes, iface: bytes, method: bytes, args: list[Any]
    ) -> Reply:
        values = [v for t, v in args if (t > 0 and not isinstance(v, bytes)) or t == ord("s")]
        self.calls.append((method, values))
        handler = self.handlers.get(method)
        return Reply(handler(values) if handler else None)

    def get_property(
        self, dest: bytes, path: bytes, iface: bytes, name: bytes, rtype: bytes
    ) -> Any:
        return self.props[(path, name)]

    def process(self) -> Reply:
        if not self.queue:
            return Reply(None)
        message = self.queue.pop(0)
        assert self.callback is not None
        self.callback(message)
        return message

    def get_fd(self) -> int:
        return -1

    def job_removed(self, job: bytes, unit: bytes, result: bytes) -> Reply:
        return Reply([int(job.rsplit(b"/", 1)[1]), job, unit, result])


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    yield read_fd, write_fd
    os.close(read_fd)
    os.close(write_fd)


def replies(read_fd: int) -> list[dict[str, Any]]:
    try:
        data = os.read(read_fd, 1 << 20)
    except BlockingIOError:
        return []
    return [json.loads(line) for line in data.splitlines()]


def make_worker(bus: FakeBus, write_fd: int) -> Worker:
    worker = Worker(bus, write_fd)
    worker.subscribe()
    return worker


def job_handler(bus: FakeBus, *, immediate: dict[bytes, bytes]) -> Callable[[list[Any]], bytes]:
    """StartUnit & co.: hand out job paths; for units in ``immediate`` fire JobRemoved at once."""

    def start(values: list[Any]) -> bytes:
        unit = values[0]
        path = f"/org/freedesktop/systemd1/job/{bus.next_job}".encode()
        bus.next_job += 1
        if unit in immediate:
            assert bus.callback is not None
            bus.callback(bus.job_removed(path, unit, immediate[unit]))
        return path

    return start


def test_job_removed_before_the_job_is_claimed_is_not_lost(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    bus = FakeBus()
    bus.handlers[b"RestartUnit"] = job_handler(bus, immediate={b"fast.service": b"done"})
    worker = make_worker(bus, write_fd)
    worker.handle_line(
        json.dumps(
            {
                "id": 7,
                "op": "jobs",
                "args": {"jobs": [["fast.service", "restart"], ["slow.service", "restart"]]},
            }
        ).encode()
    )
    worker.settle_batches()
    assert replies(read_fd) == [], "still waiting for slow.service"
    bus.queue.append(bus.job_removed(b"/org/freedesktop/systemd1/job/2", b"slow.service", b"done"))
    worker.drain_bus()
    worker.settle_batches()
    (reply,) = replies(read_fd)
    assert reply["id"] == 7
    assert [(r["unit"], r["result"], r["finished"]) for r in reply["result"]] == [
        ("fast.service", "done", True),
        ("slow.service", "done", True),
    ]
    assert worker.removed == {}


def test_a_job_still_running_at_the_deadline_times_out(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    bus = FakeBus()
    bus.handlers[b"StartUnit"] = job_handler(bus, immediate={})
    bus.handlers[b"LoadUnit"] = lambda values: b"/unit/hang"
    bus.handlers[b"GetAll"] = lambda values: {
        b"Id": b"hang.service",
        b"LoadState": b"loaded",
        b"ActiveState": b"activating",
        b"SubState": b"start",
    }
    service = {b"NRestarts": 0, b"MainPID": 0, b"ExecMainStartTimestamp": 0, b"Result": b""}
    bus.props.update({(b"/unit/hang", name): value for name, value in service.items()})
    bus.props[(b"/unit/hang", b"Type")] = b"simple"
    worker = make_worker(bus, write_fd)
    request = {
        "id": 3,
        "op": "jobs",
        "args": {"jobs": [["hang.service", "start"]], "timeout": 0.01},
    }
    worker.handle_line(json.dumps(request).encode())
    time.sleep(0.02)
    worker.settle_batches()
    (reply,) = replies(read_fd)
    (job,) = reply["result"]
    assert job["result"] == "timeout"
    assert job["finished"] is False
    assert "still running after 0.01s" in job["message"]
    assert "activating (start" in job["message"]


def test_start_of_a_missing_unit_is_an_error_and_stop_is_done(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    bus = FakeBus()

    def refuse(values: list[Any]) -> bytes:
        raise DBusNoSuchUnitError(-2, b"", b"Unit " + values[0] + b" not found.")

    bus.handlers[b"StartUnit"] = refuse
    bus.handlers[b"StopUnit"] = refuse
    worker = make_worker(bus, write_fd)
    jobs = [["gone.service", "start"], ["gone.service", "stop"]]
    worker.handle_line(json.dumps({"id": 1, "op": "jobs", "args": {"jobs": jobs}}).encode())
    worker.settle_batches()
    (reply,) = replies(read_fd)
    start, stop = reply["result"]
    assert (start["result"], start["path"]) == ("error", None)
    assert "gone.service not found" in start["message"]
    assert stop["result"] == "done"


def test_enable_of_an_alias_name_enables_the_unit_behind_it(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    bus = FakeBus()
    enabled: list[list[Any]] = []

    def enable(values: list[Any]) -> Any:
        enabled.append(values)
        if b"sshd.service" in values:
            raise DBusBaseError(
                -40,
                b"org.freedesktop.systemd1.UnitLinked",
                b"Refusing to operate on alias name or linked unit file: sshd.service",
            )
        return [
            True,
            [[b"symlink", b"/etc/systemd/system/multi-user.target.wants/ssh.service", b"/lib/x"]],
        ]

    bus.handlers[b"EnableUnitFiles"] = enable
    bus.handlers[b"LoadUnit"] = lambda values: b"/unit/" + values[0]
    bus.props = {
        (b"/unit/sshd.service", b"LoadState"): b"loaded",
        (b"/unit/sshd.service", b"Id"): b"ssh.service",
        (b"/unit/other.service", b"LoadState"): b"loaded",
        (b"/unit/other.service", b"Id"): b"other.service",
    }
    worker = make_worker(bus, write_fd)
    request = {"id": 5, "op": "enable", "args": {"units": ["sshd.service", "other.service"]}}
    worker.handle_line(json.dumps(request).encode())
    (reply,) = replies(read_fd)
    assert reply["ok"], reply
    assert reply["result"]["resolved"] == {"sshd.service": "ssh.service"}
    assert enabled[-1][:2] == [b"ssh.service", b"other.service"]
    assert reply["result"]["changes"][0][0] == "symlink"


def test_bad_requests_are_answered_not_fatal(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    worker = make_worker(FakeBus(), write_fd)
    worker.handle_line(b'{"id": 9, "op": "format_disk"}')
    worker.handle_line(b'{"id": 10, "op": "enable", "args": {"units": "not-a-list"}}')
    worker.handle_line(b"not json")
    answers = replies(read_fd)
    assert [(a["id"], a["ok"], a["error"]["kind"]) for a in answers] == [
        (9, False, "request"),
        (10, False, "request"),
        (0, False, "request"),
    ]
    assert "unknown operation" in answers[0]["error"]["message"]
