"""``node-agent reset`` on a throwaway node with a real systemd: what the agent created is gone,
what it found stays, and a second reset has nothing to do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from node_agent.base import layout
from tests.testbed.agent_harness import cli, inline_file, osc_document, service
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

AGENT = "gardener-node-agent.service"


def test_reset_removes_exactly_what_the_agent_created(
    node: IsolatedSystemd, tmp_path: Path
) -> None:
    # Found on the node before the agent: a file the OSC overwrites, and the agent's own unit
    # (installed by the image, running).
    node.path("/etc/reset-demo").mkdir(parents=True)
    node.path("/etc/reset-demo/pre.conf").write_text("from the image\n")
    node.path(f"/etc/systemd/system/{AGENT}").write_text(
        "[Service]\nExecStart=/bin/sleep infinity\n"
    )
    node.run(["systemctl", "daemon-reload"])
    node.run(["systemctl", "start", AGENT])
    osc = osc_document(
        [
            inline_file("/etc/reset-demo/a.conf", "a\n"),
            inline_file("/etc/reset-demo/pre.conf", "from the OSC\n"),
        ],
        [
            service(
                "reset-demo.service",
                filePaths=["/etc/reset-demo/a.conf"],
                dropIns=[{"name": "10-env.conf", "content": "[Service]\nEnvironment=X=1\n"}],
            )
        ],
    )
    osc_file = tmp_path / "osc.yaml"
    osc_file.write_text(yaml.safe_dump(osc))
    bus = node.bus_address.decode()
    common = ["--root", str(node.root), "--systemd-bus", bus]
    applied = cli("apply", *common, "--osc", str(osc_file), "--hostname", "h")
    assert applied.returncode == 0, applied.stderr
    assert node.run(["systemctl", "is-active", "reset-demo.service"]).stdout.strip() == "active"
    assert node.run(["systemctl", "is-enabled", "reset-demo.service"]).stdout.strip() == "enabled"
    assert node.path(f"{layout.BASE_DIR}/{layout.INVENTORY}").exists()

    reset = cli("reset", *common)
    assert reset.returncode == 0, reset.stderr
    lines = reset.stdout.splitlines()
    assert lines[:2] == [f"stopped {AGENT}", "stopped reset-demo.service"]
    assert "disabled reset-demo.service" in lines
    assert "removed file /etc/reset-demo/a.conf" in lines
    assert "removed unit /etc/systemd/system/reset-demo.service" in lines
    assert "removed dropin /etc/systemd/system/reset-demo.service.d/10-env.conf" in lines
    assert "reloaded systemd" in lines
    assert f"removed {layout.BASE_DIR}/{layout.INVENTORY}" in lines

    assert not node.path("/etc/reset-demo/a.conf").exists()
    assert not node.path("/etc/systemd/system/reset-demo.service").exists()
    assert not node.path("/etc/systemd/system/reset-demo.service.d").exists()
    assert not node.path(f"{layout.BASE_DIR}/{layout.INVENTORY}").exists()
    assert not node.path(f"{layout.BASE_DIR}/{layout.LAST_APPLIED_OSC}").exists()
    state = node.run(["systemctl", "show", "-P", "LoadState", "reset-demo.service"])
    assert state.stdout.strip() == "not-found"
    # Not the agent's: stays (the overwritten file keeps the OSC's content, as upstream).
    assert node.path("/etc/reset-demo/pre.conf").read_text() == "from the OSC\n"
    assert node.path(f"/etc/systemd/system/{AGENT}").exists()
    assert node.run(["systemctl", "is-active", AGENT], check=False).stdout.strip() == "inactive"
    assert node.path("/usr/lib/systemd/system/systemd-journald.service").exists()

    again = cli("reset", *common)
    assert again.returncode == 0, again.stderr
    assert (
        again.stdout.strip() == "nothing to do: no units, files or state of the agent on this node"
    )


def test_reset_goes_on_past_what_it_cannot_remove(node: IsolatedSystemd, tmp_path: Path) -> None:
    """A created file that became a directory, and one under a parent that became a symlink:
    reset names both, takes back everything else (the credentials too), exits 1 with a summary
    on stderr, and the next reset, once the way is clear, finishes."""
    osc = osc_document(
        [
            inline_file("/etc/reset-stuck/a.conf", "a\n"),
            inline_file("/etc/reset-linked/b.conf", "b\n"),
            inline_file("/etc/reset-zz/c.conf", "c\n"),
        ],
        [service("reset-stuck.service")],
    )
    osc_file = tmp_path / "osc.yaml"
    osc_file.write_text(yaml.safe_dump(osc))
    common = ["--root", str(node.root), "--systemd-bus", node.bus_address.decode()]
    applied = cli("apply", *common, "--osc", str(osc_file), "--hostname", "h")
    assert applied.returncode == 0, applied.stderr
    token = node.path(layout.TOKEN_FILE)
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text("secret")
    node.path("/etc/reset-stuck/a.conf").unlink()
    node.path("/etc/reset-stuck/a.conf").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "b.conf").write_text("b\n")
    node.path("/etc/reset-linked/b.conf").unlink()
    node.path("/etc/reset-linked").rmdir()
    node.path("/etc/reset-linked").symlink_to(outside)

    for _ in range(2):  # the same items each time, nothing else
        reset = cli("reset", *common)
        assert reset.returncode == 1, reset.stdout
        assert reset.stderr.splitlines()[-1].startswith(
            "node-agent: ResetIncompleteError: reset incomplete: 2 item(s) not removed "
            "(/etc/reset-linked/b.conf, /etc/reset-stuck/a.conf)"
        ), reset.stderr
        events = [
            json.loads(line) for line in reset.stderr.splitlines()[:-1]
        ]  # JSON, as the agent's
        assert [(e["event"], e["path"]) for e in events] == [
            ("not removed", "/etc/reset-linked/b.conf"),
            ("not removed", "/etc/reset-stuck/a.conf"),
        ]
        failed = [line for line in reset.stdout.splitlines() if line.startswith("not removed")]
        assert [line.split(":")[0] for line in failed] == [
            "not removed file /etc/reset-linked/b.conf",
            "not removed file /etc/reset-stuck/a.conf",
        ]
        assert not node.path("/etc/reset-zz/c.conf").exists()
        assert not node.path("/etc/systemd/system/reset-stuck.service").exists()
        assert not token.exists()
        assert (outside / "b.conf").read_text() == "b\n"

    node.path("/etc/reset-stuck/a.conf").rmdir()
    node.path("/etc/reset-linked").unlink()
    last = cli("reset", *common)
    assert last.returncode == 0, last.stdout + last.stderr
    assert f"removed {layout.BASE_DIR}/{layout.INVENTORY}" in last.stdout.splitlines()
    assert (outside / "b.conf").exists()


def test_reset_errors_are_one_line(tmp_path: Path) -> None:
    result = cli("reset", "--root", str(tmp_path), "--systemd-bus", "unix:path=/nonexistent/bus")
    assert result.returncode == 1
    assert result.stderr.startswith("node-agent: Systemd")
    assert len(result.stderr.strip().splitlines()) == 1


def test_two_resets_at_once_take_turns(node: IsolatedSystemd, tmp_path: Path) -> None:
    # Units whose stop takes a while, so that the second reset starts while the first works.
    slow = "\nExecStop=/bin/sleep 0.5\n"
    osc = osc_document(
        [inline_file(f"/etc/reset-twice/f{i}.conf", f"{i}\n") for i in range(4)],
        [service(f"twice-{i}.service", extra=slow) for i in range(4)],
    )
    osc_file = tmp_path / "osc.yaml"
    osc_file.write_text(yaml.safe_dump(osc))
    common = ["--root", str(node.root), "--systemd-bus", node.bus_address.decode()]
    applied = cli("apply", *common, "--osc", str(osc_file), "--hostname", "h")
    assert applied.returncode == 0, applied.stderr

    cmd = [sys.executable, "-m", "node_agent", "reset", *common]
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    outputs = sorted((out for out, _ in results), key=len)
    assert outputs[0].strip() == NOTHING, outputs  # the one that waited found nothing left
    assert "removed unit /etc/systemd/system/twice-3.service" in outputs[1]
    assert any("another node-agent reset" in err for _, err in results), results
    for i in range(4):
        assert not node.path(f"/etc/systemd/system/twice-{i}.service").exists()
        assert not node.path(f"/etc/reset-twice/f{i}.conf").exists()


NOTHING = "nothing to do: no units, files or state of the agent on this node"
