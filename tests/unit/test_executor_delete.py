"""An OSC that drops a file or unit the agent created removes it only while it holds the bytes
the agent wrote: a file changed since, or something else put in its place, stays, is said, and
is no longer the agent's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from node_agent.apply.applier import Applier
from node_agent.base.digest import sha256_hex
from node_agent.base.layout import BASE_DIR, unit_path
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.osc.decode import parse_osc
from node_agent.systemd.types import JobResult
from tests.unit.fakes import FakeSystemd

AGENT_UNIT = "node-agent-under-test.service"
SAME = "/etc/test/same.conf"  # unchanged since the agent wrote it: removed
EDITED = "/etc/test/edited.conf"  # an operator changed it since: kept
LINKED = "/etc/test/linked.conf"  # replaced by a symlink since: kept, its target untouched
UNIT = "edited.service"  # its unit file changed since: kept
FILES = (SAME, EDITED, LINKED)


def osc_yaml(files: tuple[str, ...], units: tuple[str, ...]) -> bytes:
    doc: dict[str, Any] = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {
            "type": "debian",
            "purpose": "reconcile",
            "files": [
                {"path": p, "permissions": 0o644, "content": {"inline": {"data": f"{p}\n"}}}
                for p in ("/etc/test/stays.conf", *files)
            ],
            "units": [
                {"name": u, "command": "start", "content": "[Service]\nExecStart=/bin/true\n"}
                for u in units
            ],
        },
    }
    return yaml.safe_dump(doc).encode()


async def apply(applier: Applier, raw: bytes) -> Any:
    return await applier.apply(raw, parse_osc(raw), sha256_hex(raw), {})


async def test_a_removed_file_or_unit_goes_only_while_it_holds_what_the_agent_wrote(
    tmp_path: Path,
) -> None:
    fs = HostFS(tmp_path)
    systemd = FakeSystemd()
    applier = Applier(fs, StateStore(fs), systemd, host_name="h", agent_unit=AGENT_UNIT)
    await apply(applier, osc_yaml(FILES, (UNIT,)))
    host = {p: tmp_path / p.lstrip("/") for p in (*FILES, unit_path(UNIT))}
    assert all(f.exists() for f in host.values())
    host[EDITED].write_bytes(b"the operator's own\n")
    host[unit_path(UNIT)].write_bytes(b"[Service]\nExecStart=/bin/operator\n")
    target = tmp_path / "target"
    target.write_bytes(f"{LINKED}\n".encode())  # even the bytes the agent wrote, elsewhere
    host[LINKED].unlink()
    host[LINKED].symlink_to(target)

    outcome = await apply(applier, osc_yaml((), ()))

    report = outcome.report
    assert report.complete, report.describe_failures()
    assert report.files_deleted == [SAME]
    assert report.units_deleted == []
    assert not host[SAME].exists()
    assert host[EDITED].read_bytes() == b"the operator's own\n"
    assert host[unit_path(UNIT)].read_bytes() == b"[Service]\nExecStart=/bin/operator\n"
    assert host[LINKED].is_symlink()
    assert target.read_bytes() == f"{LINKED}\n".encode()
    for path, why in (
        (EDITED, "its content is not what the agent wrote"),
        (unit_path(UNIT), "its content is not what the agent wrote"),
        (LINKED, "is a symlink, not the file the agent wrote"),
    ):
        assert any(note.startswith(f"{path}: kept") and why in note for note in report.skipped), (
            path,
            report.skipped,
        )
    entries = StateStore(HostFS(tmp_path)).inventory().entries
    assert not {SAME, EDITED, LINKED, unit_path(UNIT)} & set(entries)  # none is the agent's now
    assert "/etc/test/stays.conf" in entries


async def test_an_old_config_the_osc_drops_goes_from_the_agents_own_directory(
    tmp_path: Path,
) -> None:
    """A claim alone never removes anything in the agent's directory; the OSC itself does, as
    upstream: a config-<version>.yaml left behind would be picked over the lower version's
    after a Gardener downgrade."""
    fs = HostFS(tmp_path)
    applier = Applier(fs, StateStore(fs), FakeSystemd(), host_name="h", agent_unit=AGENT_UNIT)
    old = f"{BASE_DIR}/config-v1.151.0.yaml"
    await apply(applier, osc_yaml((old,), ()))
    assert (tmp_path / old.lstrip("/")).exists()
    outcome = await apply(applier, osc_yaml((f"{BASE_DIR}/config-v1.150.0.yaml",), ()))
    assert outcome.report.files_deleted == [old]
    assert not (tmp_path / old.lstrip("/")).exists()


async def test_a_unit_still_starting_at_the_job_deadline_does_not_fail_the_osc(
    tmp_path: Path,
) -> None:
    """Upstream's contract: a job still running when the wait ends is not an error (a oneshot
    such as updatecacerts.service can take minutes on a slow machine); the next OSC with the
    unit unchanged sends it no job again."""
    fs = HostFS(tmp_path)
    systemd = FakeSystemd(slow={UNIT})
    applier = Applier(fs, StateStore(fs), systemd, host_name="h", agent_unit=AGENT_UNIT)
    outcome = await apply(applier, osc_yaml((SAME,), (UNIT,)))
    report = outcome.report
    assert report.complete, report.describe_failures()
    assert report.failed == []
    assert report.results[UNIT].result == "timeout"
    assert systemd.units[UNIT] == ("activating", "start")
    jobs = len(systemd.jobs)
    outcome = await apply(applier, osc_yaml((SAME, EDITED), (UNIT,)))
    assert outcome.report.complete
    assert len([j for j in systemd.jobs[jobs:] if j[0] == UNIT]) == 0


async def test_a_stop_still_running_at_the_job_deadline_is_still_a_failure(tmp_path: Path) -> None:
    """Only a start or restart is on its way up; a unit that does not stop in time is said."""
    result = JobResult(UNIT, "stop", "timeout", finished=False)
    assert not result.ok
    assert not result.still_starting
    assert JobResult(UNIT, "restart", "timeout", finished=False).still_starting
    assert not JobResult(UNIT, "restart", "failed").still_starting
