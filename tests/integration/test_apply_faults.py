"""A partial failure never wedges a node: one test per finding of issue 8, on the real test bed.

The agent acts on a throwaway node (real systemd) and reads its OSC from the real kube-apiserver.
Units are ``counted_service``: each start appends the unit version's tag to a log on the node, so
"restarted exactly once" is counted, not guessed. What every test holds the agent to:

- a failing item (unit or file) is reported by name (a Warning Event on the Node, ``status
  --json``), everything else of the OSC is applied, and the Node's checksum annotation is set
  only when the whole OSC applied;
- retries redo only what failed; a healthy unit is restarted once per change;
- the next good OSC always converges.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from node_agent.apply.executor import CRASH_HOOK_ENV
from tests.testbed.agent_harness import (
    AgentProcess,
    OSCAgent,
    counted_service,
    eventually,
    failed_items,
    inline_file,
    osc_document,
    starts,
    status_json,
    wait_for,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

ANNOTATION = "checksum/cloud-config-data"
UNIT_DIR = "/etc/systemd/system"


def failing_service(name: str, **fields: Any) -> dict[str, Any]:
    """A unit that never starts: a oneshot whose ExecStart exits 1 (each attempt is logged)."""
    return counted_service(name, "attempt", "/bin/false", extra="Type=oneshot\n", **fields)


def active(node: IsolatedSystemd, unit: str) -> str:
    return node.run(["systemctl", "is-active", unit], check=False).stdout.strip()


def enabled(node: IsolatedSystemd, unit: str) -> str:
    return node.run(["systemctl", "is-enabled", unit], check=False).stdout.strip()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def unit_gone(node: IsolatedSystemd, unit: str) -> bool:
    """Its file removed and not running (a unit that failed may stay listed as failed)."""
    gone = not node.path(f"{UNIT_DIR}/{unit}").exists()
    return gone and active(node, unit) in ("inactive", "failed")


def temp_leftovers(node: IsolatedSystemd, *dirs: str) -> str:
    return node.run(["find", *dirs, UNIT_DIR, "-name", ".node-agent-tmp-*"]).stdout


async def failed_status(root: Path, checksum: str, timeout: float = 30.0) -> dict[str, Any]:
    """The status document once its last apply is a failure of ``checksum`` (or the last one
    seen when that never happens: the caller's assertions then say what was wrong)."""
    seen: dict[str, Any] = {}

    async def failed() -> bool:
        seen.clear()
        seen.update(await status_json(root))
        last = seen.get("last_apply") or {}
        return bool(last.get("osc_checksum") == checksum and last.get("result") == "failed")

    await eventually(failed, timeout, poll=0.5)
    return seen


def assert_failed_naming(doc: dict[str, Any], checksum: str, *items: str) -> None:
    last = doc.get("last_apply") or {}
    assert last.get("osc_checksum") == checksum, last
    assert last.get("result") == "failed", last
    listed = failed_items(doc)
    for item in items:
        assert any(item in entry for entry in listed), f"{item} not among failures {listed}"


# --- finding 1 --------------------------------------------------------------------------------


async def test_finding_1_failed_apply_that_removed_a_unit_does_not_block_later_oscs(
    agent: OSCAgent,
) -> None:
    node = agent.node
    conf = "/etc/f1/keep.conf"

    def keep(tag: str) -> dict[str, Any]:
        return counted_service("keep.service", tag, filePaths=[conf])

    a = osc_document([inline_file(conf, "a\n")], [keep("k-a"), counted_service("x.service", "x")])
    checksum_a = await agent.publish(a)
    await agent.wait_applied(checksum_a)
    assert active(node, "x.service") == "active"

    # B drops x.service, changes keep.service and adds a unit that can never start.
    b = osc_document([inline_file(conf, "b\n")], [keep("k-b"), failing_service("bad.service")])
    checksum_b = await agent.publish(b)
    message = await agent.wait_warning("bad.service")
    b_others_applied = await eventually(
        lambda: (
            starts(node, "keep.service") == ["k-a", "k-b"]
            and node.path(conf).read_text() == "b\n"
            and unit_gone(node, "x.service")
        ),
        30,
    )
    b_status = await failed_status(node.root, checksum_b)
    b_annotation = (await agent.node_annotations()).get(ANNOTATION)

    # C, a good OSC without x and bad: it converges (it used to fail forever with
    # "disable x.service: Unit file does not exist").
    c = osc_document([inline_file(conf, "c\n")], [keep("k-c"), counted_service("y.service", "y")])
    checksum_c = await agent.publish(c)
    await agent.wait_applied(checksum_c)
    assert node.path(conf).read_text() == "c\n"
    assert active(node, "keep.service") == "active"
    assert active(node, "y.service") == "active"
    assert enabled(node, "y.service") == "enabled"
    assert unit_gone(node, "x.service")
    assert unit_gone(node, "bad.service")  # written by B, wanted by no later OSC

    # And D after it.
    d = osc_document([inline_file(conf, "d\n")], [keep("k-d")])
    checksum_d = await agent.publish(d)
    await agent.wait_applied(checksum_d)
    assert node.path(conf).read_text() == "d\n"
    assert unit_gone(node, "y.service")
    # One start per version of keep.service: B's failure and its retries restarted it once.
    assert starts(node, "keep.service") == ["k-a", "k-b", "k-c", "k-d"]
    assert temp_leftovers(node, "/etc/f1") == ""

    # What B's failure looked like: named, the rest of B applied, B not reported as applied.
    assert "failed" in message or "exit-code" in message, message
    assert b_others_applied, "the rest of B (keep.service, x.service removed) was not applied"
    assert_failed_naming(b_status, checksum_b, "bad.service")
    assert b_annotation == checksum_a


# --- finding 2 --------------------------------------------------------------------------------


def crash_osc(version: str) -> dict[str, Any]:
    """A: keep + x. B: keep changed, x dropped, y added, a file of its own. C: keep as in B,
    y dropped, z added, a file of its own."""
    shared = "/etc/f2/shared.conf"
    keep_tag = {"a": "k-a", "b": "k-b", "c": "k-b"}[version]
    files = [
        inline_file(shared, "a\n" if version == "a" else "b\n"),
        inline_file(f"/etc/f2/{version}-only.conf", f"{version}\n"),
    ]
    units = [counted_service("keep.service", keep_tag, filePaths=[shared])]
    units.append(counted_service({"a": "x", "b": "y", "c": "z"}[version] + ".service", version))
    return osc_document(files, units)


@pytest.mark.parametrize("crash_after", ["file", "cmd", "delete-unit"])
async def test_finding_2_kill_mid_apply_and_a_newer_osc_while_down_converges(
    harness: OSCAgent, tmp_path: Path, crash_after: str
) -> None:
    node = harness.node
    agent = AgentProcess(harness, tmp_path / "agent.log")
    try:
        checksum_a = await harness.publish(crash_osc("a"))
        await agent.start()
        await harness.wait_applied(checksum_a)
        assert await agent.terminate() == 0, agent.log_tail()

        await harness.publish(crash_osc("b"))
        await agent.start(**{CRASH_HOOK_ENV: crash_after})
        code = await agent.wait(30)
        assert code == -9, f"the crash hook did not fire after {crash_after}: {code}"
        checksum_c = await harness.publish(crash_osc("c"))  # while the agent is down

        await agent.start()
        await harness.wait_applied(checksum_c)
        assert node.path("/etc/f2/shared.conf").read_text() == "b\n"
        assert node.path("/etc/f2/c-only.conf").read_text() == "c\n"
        assert not node.path("/etc/f2/a-only.conf").exists()
        assert not node.path("/etc/f2/b-only.conf").exists()
        for unit in ("keep.service", "z.service"):
            assert active(node, unit) == "active", unit
            assert enabled(node, unit) == "enabled", unit
        assert unit_gone(node, "x.service")
        assert unit_gone(node, "y.service")
        # keep.service is the same in B and C: one start for that version, whether B's restart
        # happened before the kill or not.
        assert starts(node, "keep.service") == ["k-a", "k-b"]
        assert temp_leftovers(node, "/etc/f2") == ""
        assert await agent.terminate() == 0, agent.log_tail()
    except BaseException:
        print(agent.log_tail(60))
        raise
    finally:
        await agent.kill()


# --- finding 3 --------------------------------------------------------------------------------


async def test_finding_3_failed_write_under_a_read_only_mount_does_not_block_later_oscs(
    agent: OSCAgent,
) -> None:
    node = agent.node
    node.run(["mkdir", "-p", "/srv/ro"])
    node.run(["mount", "--bind", "/srv/ro", "/srv/ro"])  # in the node's own mount namespace
    node.run(["mount", "-o", "remount,bind,ro", "/srv/ro"])
    assert node.run(["touch", "/srv/ro/probe"], check=False).returncode != 0

    app_conf, other = "/etc/f3/app.conf", "/etc/f3/other.conf"

    def version(n: int, *, read_only_file: bool) -> dict[str, Any]:
        files = [inline_file(app_conf, f"app {n}\n"), inline_file(other, f"other {n}\n")]
        units = [counted_service("app.service", f"app-{n}", filePaths=[app_conf])]
        if n >= 2:
            units.append(counted_service("new.service", "new"))
        if read_only_file:
            files.append(inline_file("/srv/ro/new", "cannot be written\n"))
        return osc_document(files, units)

    checksum_1 = await agent.publish(version(1, read_only_file=False))
    await agent.wait_applied(checksum_1)

    checksum_2 = await agent.publish(version(2, read_only_file=True))
    message = await agent.wait_warning("/srv/ro/new")
    v2_others_applied = await eventually(
        lambda: (
            node.path(app_conf).read_text() == "app 2\n"
            and node.path(other).read_text() == "other 2\n"
            and starts(node, "app.service") == ["app-1", "app-2"]
            and active(node, "new.service") == "active"
        ),
        30,
    )
    v2_status = await failed_status(node.root, checksum_2)
    v2_annotation = (await agent.node_annotations()).get(ANNOTATION)

    # v3 drops the file it could not write: it converges (it used to fail forever with
    # "remove /srv/ro/new: Read-only file system").
    checksum_3 = await agent.publish(version(3, read_only_file=False))
    await agent.wait_applied(checksum_3)
    assert node.path(app_conf).read_text() == "app 3\n"
    assert node.path(other).read_text() == "other 3\n"
    assert active(node, "app.service") == "active"
    assert active(node, "new.service") == "active"
    assert not node.path("/srv/ro/new").exists()
    # One start per version: v2's retries did not restart app.service again.
    assert starts(node, "app.service") == ["app-1", "app-2", "app-3"]
    assert starts(node, "new.service") == ["new"]

    assert "Read-only file system" in message, message
    assert v2_others_applied, "the rest of v2 was not applied"
    assert_failed_naming(v2_status, checksum_2, "/srv/ro/new")
    assert v2_annotation == checksum_1


# --- finding 4 --------------------------------------------------------------------------------


@pytest.mark.parametrize("hold", [False, True], ids=["spaced", "held"])
async def test_finding_4_failing_unit_does_not_restart_its_healthy_siblings_on_retries(
    agent: OSCAgent, hold: bool
) -> None:
    """The restart-storm guard spaces the failing unit's retries out (upstream retries for
    ever), or holds it with the operator's holdFailingUnits; either way the healthy sibling is
    restarted once."""
    node = agent.node
    if hold:
        strict = node.path("/var/lib/gardener-node-agent/node-agent-strict.yaml")
        strict.parent.mkdir(parents=True, exist_ok=True)
        strict.write_text(
            "apiVersion: node-agent.gardener.cloud/v1alpha1\nkind: Strictness\n"
            "holdFailingUnits: true\n"
        )
    checksum_a = await agent.publish(osc_document([], [counted_service("healthy.service", "h-a")]))
    await agent.wait_applied(checksum_a)

    checksum_b = await agent.publish(
        osc_document(
            [], [counted_service("healthy.service", "h-b"), failing_service("sibling.service")]
        )
    )
    published = time.monotonic()
    # The agent retries; after its third failed start (the restart-storm guard's default) it
    # spaces the starts of sibling.service out (or stops them) and says so, while the apply
    # keeps being retried.
    said = "not restarted again" if hold else "restarted again in 5s at the earliest"
    held = await agent.wait_warning("sibling.service", said, timeout=90)
    assert "3 restarts" in held, held
    await asyncio.sleep(max(0.0, 30 - (time.monotonic() - published)))

    attempts = len(starts(node, "sibling.service"))
    print(
        f"sibling.service attempts over 30 s: {attempts}; healthy.service starts: "
        f"{starts(node, 'healthy.service')}"
    )
    if hold:
        assert attempts == 3  # the guard's limit, not one start per retry
    else:
        assert 3 < attempts <= 6  # retried, with pauses of 5 s, 10 s, 20 s after the third
    assert starts(node, "healthy.service") == ["h-a", "h-b"]  # restarted once for its change
    assert active(node, "healthy.service") == "active"
    assert (await agent.node_annotations()).get(ANNOTATION) == checksum_a
    assert_failed_naming(await failed_status(node.root, checksum_b), checksum_b, "sibling.service")

    # Without the failing unit the OSC converges, and the healthy unit is not restarted again.
    checksum_c = await agent.publish(osc_document([], [counted_service("healthy.service", "h-b")]))
    await agent.wait_applied(checksum_c)
    assert unit_gone(node, "sibling.service")
    assert starts(node, "healthy.service") == ["h-a", "h-b"]


# --- finding 5 --------------------------------------------------------------------------------


async def test_finding_5_unknown_and_masked_units_do_not_stop_the_others(
    agent: OSCAgent,
) -> None:
    node = agent.node
    masked = "vendor-daemon.service"
    node.path(f"/usr/lib/systemd/system/{masked}").write_text(
        "[Service]\nExecStart=/bin/sleep infinity\n"
    )
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "mask", masked])
    assert enabled(node, masked) == "masked"
    # Like containerd.service on a node where containerd is not installed (the test machine may
    # have it: a name nobody installs plays that part).
    unknown = "absent-runtime.service"
    listed = node.run(["systemctl", "list-unit-files", "absent-runtime*"], check=False).stdout
    assert "absent-runtime" not in listed

    def osc(*, with_bad_units: bool) -> dict[str, Any]:
        files = [inline_file("/etc/f5/app.conf", "app\n")]
        units = [
            counted_service("h1.service", "h1", filePaths=["/etc/f5/app.conf"]),
            counted_service("h2.service", "h2"),
        ]
        if with_bad_units:
            files += [
                inline_file("/etc/f5/containerd.conf", "c\n"),
                inline_file("/etc/f5/masked.conf", "m\n"),
            ]
            # As in a real Gardener OSC: units with no content, only files that restart them.
            units += [
                {"name": unknown, "filePaths": ["/etc/f5/containerd.conf"]},
                {"name": masked, "command": "restart", "filePaths": ["/etc/f5/masked.conf"]},
            ]
        return osc_document(files, units)

    checksum_bad = await agent.publish(osc(with_bad_units=True))
    healthy_up = await eventually(
        lambda: all(
            active(node, u) == "active" and enabled(node, u) == "enabled"
            for u in ("h1.service", "h2.service")
        ),
        30,
    )
    assert healthy_up, "one unknown and one masked unit kept the healthy units from starting"
    unknown_message = await agent.wait_warning(unknown)
    masked_message = await agent.wait_warning(masked, "masked")
    assert_failed_naming(
        await failed_status(node.root, checksum_bad), checksum_bad, unknown, masked
    )
    assert node.path("/etc/f5/containerd.conf").read_text() == "c\n"
    assert node.path("/etc/f5/masked.conf").read_text() == "m\n"
    assert (await agent.node_annotations()).get(ANNOTATION) != checksum_bad
    reasons = ("not found", "not-found", "does not exist", "No such file")
    assert any(r in unknown_message for r in reasons), unknown_message

    checksum_good = await agent.publish(osc(with_bad_units=False))
    await agent.wait_applied(checksum_good)
    assert enabled(node, masked) == "masked"  # never unmasked behind the admin's back
    assert not node.path("/etc/f5/containerd.conf").exists()
    assert starts(node, "h1.service") == ["h1"]
    assert starts(node, "h2.service") == ["h2"]
    assert masked_message


# --- finding 8 (the test bed part) ------------------------------------------------------------


@pytest.mark.parametrize("special", ["directory", "fifo"])
async def test_finding_8_special_file_at_a_target_path_refuses_the_osc_before_any_write(
    agent: OSCAgent, special: str
) -> None:
    node = agent.node
    target = "/etc/f8/target"

    def osc(n: int, *, with_target: bool) -> dict[str, Any]:
        files = [
            inline_file("/etc/f8/a.conf", f"a {n}\n"),
            inline_file(f"/etc/f8/b-{n}.conf", "b\n"),
            inline_file(f"/etc/f8/z-{n}.conf", "z\n"),
        ]
        if with_target:
            files.append(inline_file(target, "a regular file\n"))
        units = [counted_service("app.service", f"app-{n}", filePaths=["/etc/f8/a.conf"])]
        return osc_document(files, units)

    checksum_1 = await agent.publish(osc(1, with_target=False))
    await agent.wait_applied(checksum_1)
    if special == "directory":
        node.run(["mkdir", "-p", f"{target}/inside"])
        is_special = stat.S_ISDIR
    else:
        node.run(["mkfifo", target])
        is_special = stat.S_ISFIFO

    checksum_2 = await agent.publish(osc(2, with_target=True))
    message = await agent.wait_warning(target)
    v2_status = await failed_status(node.root, checksum_2)
    # Refused as a whole, before the first write.
    assert is_special(os.lstat(node.path(target)).st_mode), f"the {special} was replaced"
    assert node.path("/etc/f8/a.conf").read_text() == "a 1\n"
    assert not node.path("/etc/f8/b-2.conf").exists()
    assert not node.path("/etc/f8/z-2.conf").exists()
    assert starts(node, "app.service") == ["app-1"]
    assert (await agent.node_annotations()).get(ANNOTATION) == checksum_1
    last = v2_status.get("last_apply") or {}
    assert last.get("osc_checksum") == checksum_2, last
    assert last.get("result") == "failed", last
    assert message

    checksum_3 = await agent.publish(osc(3, with_target=False))
    await agent.wait_applied(checksum_3)
    assert node.path("/etc/f8/a.conf").read_text() == "a 3\n"
    assert node.path("/etc/f8/b-3.conf").exists()
    assert not node.path("/etc/f8/b-1.conf").exists()
    assert starts(node, "app.service") == ["app-1", "app-3"]
    assert is_special(os.lstat(node.path(target)).st_mode)  # not the agent's: left alone


# --- finding 10 -------------------------------------------------------------------------------


async def test_finding_10_unit_files_are_0600_and_a_chmod_is_repaired_without_a_restart(
    agent: OSCAgent,
) -> None:
    node = agent.node
    unit = counted_service(
        "secretive.service",
        "s1",
        dropIns=[{"name": "10-env.conf", "content": "[Service]\nEnvironment=TOKEN=t\n"}],
    )
    checksum = await agent.publish(osc_document([], [unit]))
    await agent.wait_applied(checksum)
    unit_file = node.path(f"{UNIT_DIR}/secretive.service")
    dropin = node.path(f"{UNIT_DIR}/secretive.service.d/10-env.conf")
    assert mode(unit_file) == 0o600
    assert mode(dropin) == 0o600
    before = (await agent.unit_states(["secretive.service"]))["secretive.service"]

    os.chmod(unit_file, 0o644)
    os.chmod(dropin, 0o644)
    assert agent.controller is not None
    agent.controller.request_resync()
    await wait_for(
        lambda: mode(unit_file) == 0o600 and mode(dropin) == 0o600,
        30,
        "the periodic check to restore 0600",
    )
    after = (await agent.unit_states(["secretive.service"]))["secretive.service"]
    assert after.invocation_id == before.invocation_id
    assert after.active_state == "active"
    assert starts(node, "secretive.service") == ["s1"]
