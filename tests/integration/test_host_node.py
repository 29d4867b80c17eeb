"""HostFS and StateStore on a throwaway node (overlay of the real root, real systemd as PID 1).

Proves what unit tests on a temp directory cannot: the real distro layout (merged /usr
symlinks) is handled as designed, and systemd accepts the unit files and drop-ins HostFS writes.
"""

from __future__ import annotations

import os
import stat

import pytest

from node_agent.base.errors import UnsafePathError
from node_agent.base.layout import drop_in_path, unit_path
from node_agent.host.fs import HostFS
from node_agent.host.state import UNIT_FILE_MODE, StateStore, claims_for
from node_agent.osc.plan import ChangeSet, DropInWrite, UnitWrite
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UNIT = "host-seam.service"
UNIT_TEXT = """\
[Unit]
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sleep infinity
"""
DROPIN_TEXT = "[Service]\nEnvironment=FROM_DROPIN=yes\n"


def test_units_written_through_hostfs_are_loaded_by_systemd(node: IsolatedSystemd) -> None:
    fs = HostFS(node.root)  # /proc/<pid>/root: the node's root, seen from the host
    store = StateStore(fs)
    cs = ChangeSet(
        units_to_write=(UnitWrite(name=UNIT, content=UNIT_TEXT, reason="new"),),
        dropins_to_write=(
            DropInWrite(unit=UNIT, name="10-env.conf", content=DROPIN_TEXT, reason="new"),
        ),
    )
    store.begin(cs, "checksum")
    for claim in claims_for(cs):
        text = UNIT_TEXT if claim.kind == "unit" else DROPIN_TEXT
        assert fs.write_atomic(claim.path, text.encode(), UNIT_FILE_MODE)
    store.record_written(claims_for(cs))  # claimed once written, as the executor does
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", UNIT])
    env = node.run(["systemctl", "show", "-P", "Environment", UNIT]).stdout.strip()
    assert env == "FROM_DROPIN=yes"
    assert node.run(["systemctl", "is-active", UNIT]).stdout.strip() == "active"

    drop_in_dir = node.path(unit_path(UNIT) + ".d")
    assert stat.S_IMODE(os.stat(drop_in_dir).st_mode) == 0o755
    assert [p.name for p in drop_in_dir.iterdir()] == ["10-env.conf"]  # no temp files
    assert store.owns(unit_path(UNIT))
    assert store.owns(drop_in_path(UNIT, "10-env.conf"))

    # same content again: nothing written, the unit is not touched
    for claim in claims_for(cs):
        text = UNIT_TEXT if claim.kind == "unit" else DROPIN_TEXT
        assert not fs.write_atomic(claim.path, text.encode(), UNIT_FILE_MODE)
    node.run(["systemctl", "stop", UNIT])
    store.finish()


def test_merged_usr_layout_of_the_real_root(node: IsolatedSystemd) -> None:
    # The supported test machines (Debian 12) are merged-/usr: /lib is a link to usr/lib.
    assert os.path.islink("/lib"), "the test bed expects a merged-/usr host root"
    with pytest.raises(UnsafePathError):
        HostFS(node.root).write_atomic("/lib/node-agent-test/x", b"x", 0o644)
    following = HostFS(node.root, follow_system_symlinks=True)
    assert following.write_atomic("/lib/node-agent-test/x", b"x", 0o644)
    real = os.readlink("/lib").lstrip("/")
    assert node.path(f"/{real}/node-agent-test/x").read_bytes() == b"x"
    assert node.run(["cat", "/lib/node-agent-test/x"]).stdout == "x"
    assert not os.path.exists("/lib/node-agent-test")  # the host is untouched
