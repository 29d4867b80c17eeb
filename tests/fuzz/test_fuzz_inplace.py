"""Fuzz: an in-place update through the OSC controller, on fakes, up to what reaches the Node.

The pure path's last stage has one caller that does I/O: the in-place updater builds the OS
update command from the OSC and reports its outcome on the Node. A node on fakes (the unit
tests' ``FakeKube`` and ``FakeSystemd``, a throwaway root) applies a good in-place OSC, is
drained, then gets a generated one; the command is never run: process creation is replaced by
a stand-in that checks the arguments as ``exec`` does (a NUL is a ValueError there) and answers
with a generated exit code and output, huge ones included. The reconcile (and the one after a
restart) may only end with the errors the controller's loop catches (``NodeAgentError``), and
every Node patch must fit the API server's annotation budget (256 KiB in all), or
machine-controller-manager never learns the outcome (issue 33, findings 1 and 2).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.agent import build_applier
from node_agent.context import AgentContext
from node_agent.controllers.osc.controller import OSCController
from tests.fuzz import harness
from tests.fuzz.harness import bounded, budget, expect, only
from tests.fuzz.strategies import osc_docs
from tests.unit.fakes import make_ctx
from tests.unit.test_inplace import SECRET, Host, osc_doc, secret

#: a failure takes minutes to shrink; a pass takes seconds
pytestmark = pytest.mark.timeout(900)

#: the API server's limit on all annotations of an object together (apimachinery's
#: TotalAnnotationSizeLimitB)
ANNOTATION_BUDGET = 256 * 1024


class _Process:
    """What ``asyncio.create_subprocess_exec`` returns, as a process that printed ``output``
    (stdout and stderr together) and exited with ``code``: its output can be read whole
    (``communicate``) or as a stream (``stdout``)."""

    def __init__(self, code: int, output: bytes) -> None:
        self.returncode = code
        self.pid = 4242
        self.stdin = None
        self.stderr = None
        self.stdout = asyncio.StreamReader(limit=1 << 16)
        self.stdout.feed_data(output)
        self.stdout.feed_eof()

    async def communicate(self, input: bytes | None = None) -> tuple[bytes, None]:
        return await self.stdout.read(), None

    def kill(self) -> None:
        pass

    def terminate(self) -> None:
        pass

    def send_signal(self, signum: int) -> None:
        pass

    async def wait(self) -> int:
        return self.returncode


def _exec(answers: list[tuple[int, bytes]]) -> Any:
    async def create_subprocess_exec(*argv: Any, **kwargs: Any) -> _Process:
        for arg in argv:  # what exec checks before anything runs
            if b"\x00" in os.fsencode(arg):
                raise ValueError("embedded null byte")
        code, output = answers.pop(0) if answers else (0, b"update staged\n")
        if code == 127:
            raise FileNotFoundError(2, "No such file or directory", str(argv[0]))
        return _Process(code, output)

    return create_subprocess_exec


def _controller(host: Host) -> OSCController:
    ctx: AgentContext = make_ctx(
        host.root,
        config={
            "controllers": {"operatingSystemConfig": {"secretName": SECRET}},
            "nodeAgent": {"healthGate": {"enabled": False}},
        },
        kube=host.kube,
        systemd=host.systemd,
    )
    applier = build_applier(
        ctx.fs, ctx.state, host.systemd, ctx.settings, host_name="n1", images=None, expander=None
    )
    ctl = OSCController(ctx, applier)
    ctl.inplace._boot = lambda: f"boot-{host.boot}"  # type: ignore[method-assign]
    ctl.inplace.retry_interval = 0.001
    ctl.inplace.retry_timeout = 0.01
    ctl.inplace.health_interval = 0.001
    ctl.inplace.health_timeout = 0.005
    return ctl


def _annotation_bytes(annotations: Any) -> int:
    if not isinstance(annotations, dict):
        return 0
    return sum(len(str(k).encode()) + len(str(v or "").encode()) for k, v in annotations.items())


async def scenario(root: Path, doc: dict[str, Any], answers: list[tuple[int, bytes]]) -> Host:
    host = Host(root)
    first = _controller(host)
    await first.reconcile(secret(osc_doc()))  # a good in-place OSC, applied
    await host.set_condition("ReadyForUpdate")  # drained
    update = secret(doc)
    with only(harness.RECONCILE, "reconcile (in-place update)"):
        await first.reconcile(update)
    host.reboot()
    with only(harness.RECONCILE, "reconcile (after a restart)"):
        await _controller(host).reconcile(update)
    return host


def check_patches(host: Host) -> None:
    for call in host.kube.writes("patch_node"):
        patch = call[2]
        size = _annotation_bytes((patch.get("metadata") or {}).get("annotations"))
        if size > ANNOTATION_BUDGET:
            expect(
                False,
                "Node patch",
                f"a Node patch carries {size} bytes of annotations, over the API server's "
                f"{ANNOTATION_BUDGET} (issue 33, finding 2)",
            )
        json.dumps(patch)
    node = host.kube.nodes().items.get("n1") or {}
    total = _annotation_bytes((node.get("metadata") or {}).get("annotations"))
    expect(total <= ANNOTATION_BUDGET, "Node annotations", lambda: f"{total} bytes")


def outputs() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"network problems", b"invalid arguments", b"system failure", b""]),
        st.builds(
            lambda piece, n: piece * n,
            st.sampled_from([b"x", b"network problems\n", b"\x1b[31m", "\u00e9".encode()]),
            st.integers(1, 40_000),
        ),
    )


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("fuzz-inplace")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _update(**kw: Any) -> dict[str, Any]:
    return osc_doc(os_version="1877.5", **kw)


def _with_args(doc: dict[str, Any], command: str, args: Sequence[Any]) -> dict[str, Any]:
    doc["status"]["inPlaceUpdates"]["osUpdate"] = {"command": command, "args": list(args)}
    return doc


def run(roots: Path, doc: dict[str, Any], answers: list[tuple[int, bytes]]) -> None:
    harness.example((doc, answers))
    root = roots / "node"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    with bounded("in-place controller"), mock.patch.object(os, "fsync", return_value=None):
        with mock.patch.object(asyncio, "create_subprocess_exec", _exec(list(answers))):
            host = asyncio.run(scenario(root, doc, list(answers)))
        check_patches(host)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("doc", "answers"),
    [
        (_update(kubelet="1.3\u00b2"), []),
        (_update(command="/opt/up\x00date.sh"), []),
        (_with_args(_update(), "/opt/update.sh", ["--v", "18\x0077"]), []),
        (_update(), [(1, b"x" * 400_000)]),
        (_update(), [(1, b"network problems\n" * 30_000)] * 40),
    ],
    ids=[
        "kubelet-1.3-superscript-two",
        "nul-in-command",
        "nul-in-argument",
        "400-KB-of-output",
        "retried-500-KB-of-output",
    ],
)
def test_an_input_known_to_break_the_update_fails_it_typed(
    roots: Path, doc: dict[str, Any], answers: list[tuple[int, bytes]]
) -> None:
    """Issue 33's inputs (findings 1 and 2): the update fails with a reason on the Node that
    fits the API server's budget; the agent goes on."""
    run(roots, doc, answers)


@budget(short=10)
@given(
    doc=osc_docs(),
    answers=st.lists(st.tuples(st.sampled_from([0, 1, 2, 127, -1]), outputs()), max_size=3),
)
def test_an_in_place_update_fails_typed_within_the_annotation_budget(
    roots: Path, doc: dict[str, Any], answers: list[tuple[int, bytes]]
) -> None:
    run(roots, doc, answers)
