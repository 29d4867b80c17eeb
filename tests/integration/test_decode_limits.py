"""The real ``node-agent`` process refuses input that used to crash it or be coerced: a deeply
nested osc.yaml (the YAML composer recursed until SIGSEGV), a mode given as a string, a path the
file system cannot hold, a file over the agent's own state or over one of the OSC's own units.
``plan`` and ``apply`` print one line and exit 1 before anything is written under ``--root``;
``run`` reports each such Secret as ``OSCInvalid``, keeps what it applied, and keeps running."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.testbed.agent_harness import AgentProcess, OSCAgent, inline_file, osc_document, service

pytestmark = pytest.mark.integration

NODE_AGENT = Path(sys.executable).parent / "node-agent"
HEAD = "apiVersion: extensions.gardener.cloud/v1alpha1\nkind: OperatingSystemConfig\n"
LEVELS = 30_000  # about 60 KB of brackets; the composer used to overflow the stack at this depth


def node_agent(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script, as an operator runs it."""
    assert NODE_AGENT.is_file(), f"{NODE_AGENT} is not installed"
    return subprocess.run(
        [str(NODE_AGENT), *args], capture_output=True, text=True, timeout=120, check=False
    )


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def refused(result: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a clean refusal (exit 1, no traceback, not a signal)."""
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    return lines[0]


DEEP = {
    "flow-seq": HEAD + "spec:\n  x: " + "[" * LEVELS + "]" * LEVELS + "\n",
    "flow-map": HEAD + "spec:\n  x: " + "{a: " * LEVELS + "b" + "}" * LEVELS + "\n",
    "json": (
        '{"apiVersion": "extensions.gardener.cloud/v1alpha1", "kind": "OperatingSystemConfig", '
        '"spec": {"x": ' + '{"a": ' * LEVELS + "1" + "}" * LEVELS + "}}"
    ),
    "block-seq": HEAD + "spec:\n  x:\n  " + "- " * LEVELS + "a\n",
    "block-map": HEAD + "spec:\n  x:\n    " + "? " * LEVELS + "a\n",
}


@pytest.mark.parametrize("shape", sorted(DEEP))
def test_plan_refuses_a_deeply_nested_osc_without_crashing(shape: str, tmp_path: Path) -> None:
    osc = tmp_path / "deep.yaml"
    osc.write_text(DEEP[shape])
    root = tmp_path / "root"
    root.mkdir()

    result = node_agent("plan", "--osc", str(osc), "--root", str(root), "--hostname", "node-a")

    line = refused(result)
    assert line.startswith(
        "node-agent: OSCDecodeError: osc.yaml nests collections deeper than 64 levels (line "
    ), line
    assert tree(root) == []


def good_file() -> dict[str, object]:
    return inline_file("/etc/first/a.conf", "first\n", 0o644)


def apply_refused(tmp_path: Path, text: str) -> tuple[str, Path]:
    """``apply --offline`` of ``text`` into a root holding one state file; nothing may change."""
    osc = tmp_path / "osc.yaml"
    osc.write_text(text)
    root = tmp_path / "root"
    state = root / "var/lib/gardener-node-agent"
    state.mkdir(parents=True)
    (state / "inventory.json").write_text("{}\n")
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}
    dirs = tree(root)

    result = node_agent(
        "apply", "--osc", str(osc), "--offline", "--root", str(root), "--hostname", "node-a"
    )

    line = refused(result)
    assert tree(root) == dirs
    after = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}
    assert after == before
    return line, root


def test_apply_refuses_a_deep_osc_before_any_write(tmp_path: Path) -> None:
    line, _ = apply_refused(tmp_path, DEEP["flow-seq"])
    assert "osc.yaml nests collections deeper than 64 levels" in line


def dump(files: list[dict[str, object]], units: list[dict[str, object]] | None = None) -> str:
    return yaml.safe_dump(osc_document(files, units or []))


def test_apply_refuses_a_string_mode(tmp_path: Path) -> None:
    bad = inline_file("/etc/second/b.conf", "b\n", 0o644) | {"permissions": "0644"}
    line, _ = apply_refused(tmp_path, dump([good_file(), bad]))
    assert line == (
        "node-agent: OSCValidationError: spec.files[1].permissions (/etc/second/b.conf): "
        "permissions must be an integer (octal in YAML such as 0644, or 420), got the string '0644'"
    )


def test_apply_refuses_duplicate_keys(tmp_path: Path) -> None:
    text = dump([good_file()]).replace(
        "kind: OperatingSystemConfig\n", "kind: x\nkind: OperatingSystemConfig\n"
    )
    line, _ = apply_refused(tmp_path, text)
    assert line.startswith("node-agent: OSCDecodeError: osc.yaml has the mapping key 'kind' twice")


def test_apply_refuses_a_file_over_the_agents_inventory(tmp_path: Path) -> None:
    bad = inline_file("/var/lib/gardener-node-agent/inventory.json", "[]\n", 0o600)
    line, root = apply_refused(tmp_path, dump([good_file(), bad]))
    assert "is reserved for the agent's own state" in line
    assert (root / "var/lib/gardener-node-agent/inventory.json").read_text() == "{}\n"


def test_apply_refuses_a_file_over_one_of_its_own_units(tmp_path: Path) -> None:
    bad = inline_file("/etc/systemd/system/demo.service", "[Unit]\n", 0o644)
    line, _ = apply_refused(tmp_path, dump([good_file(), bad], [service("demo.service")]))
    assert line == (
        "node-agent: OSCValidationError: file /etc/systemd/system/demo.service is also the unit "
        "file of demo.service in this OSC"
    )


def test_apply_refuses_a_ten_thousand_component_path(tmp_path: Path) -> None:
    bad = inline_file("/d" * 10_000, "x\n", 0o644)
    line, _ = apply_refused(tmp_path, dump([good_file(), bad]))
    assert "is 20000 bytes long, over the limit of 4095" in line
    assert len(line) < 400


def test_apply_refuses_a_unit_name_too_long_for_its_drop_ins(tmp_path: Path) -> None:
    name = "u" * 246 + ".service"
    unit = service(name) | {"dropIns": [{"name": "10-a.conf", "content": "[Service]\n"}]}
    line, _ = apply_refused(tmp_path, dump([good_file()], [unit]))
    assert "is too long for drop-ins" in line
    assert "would be 256 bytes, over the file system's limit of 255" in line


# --- the same input as the node's Secret, to the running agent --------------------------------


def limits_osc(*extra: dict[str, Any], data: str = "a\n") -> dict[str, Any]:
    unit = service("limits.service", filePaths=["/etc/limits/a.conf"])
    return osc_document([inline_file("/etc/limits/a.conf", data), *extra], [unit])


def bad_secrets() -> list[tuple[str, bytes, str]]:
    good = yaml.safe_dump(limits_osc())
    long_unit = service("u" * 246 + ".service")
    long_unit["dropIns"] = [{"name": "10-a.conf", "content": "[Service]\n"}]
    with_long_unit = limits_osc()
    with_long_unit["spec"]["units"].append(long_unit)
    return [
        ("deep flow YAML", DEEP["flow-seq"].encode(), "nests collections deeper than 64 levels"),
        ("deep JSON", DEEP["json"].encode(), "deeper than 64 levels (line 1)"),
        (
            "string mode",
            yaml.safe_dump(
                limits_osc(inline_file("/etc/limits/b.conf", "b\n") | {"permissions": "0644"})
            ).encode(),
            "permissions must be an integer",
        ),
        (
            "duplicate key",
            good.replace(
                "kind: OperatingSystemConfig\n", "kind: x\nkind: OperatingSystemConfig\n"
            ).encode(),
            "the mapping key 'kind' twice",
        ),
        (
            "file over the inventory",
            yaml.safe_dump(
                limits_osc(inline_file("/var/lib/gardener-node-agent/inventory.json", "{}"))
            ).encode(),
            "reserved for the agent's own state",
        ),
        (
            "file over its own unit",
            yaml.safe_dump(
                limits_osc(inline_file("/etc/systemd/system/limits.service", "[Unit]\n"))
            ).encode(),
            "is also the unit file of limits.service",
        ),
        (
            "10,000-component path",
            yaml.safe_dump(limits_osc(inline_file("/d" * 10_000, "x"))).encode(),
            "is 20000 bytes long",
        ),
        ("unit too long for drop-ins", yaml.safe_dump(with_long_unit).encode(), "for drop-ins"),
    ]


async def reported_invalid(harness: OSCAgent, agent: AgentProcess, needle: str, label: str) -> str:
    """The OSCInvalid Event naming ``needle``; fails at once if the agent exits instead."""
    assert agent.proc is not None
    event = asyncio.ensure_future(harness.wait_event("OSCInvalid", needle))
    exited = asyncio.ensure_future(agent.proc.wait())
    await asyncio.wait({event, exited}, return_when=asyncio.FIRST_COMPLETED)
    if exited.done():
        event.cancel()
        raise AssertionError(f"{label}: the agent exited with {exited.result()}")
    exited.cancel()
    return event.result()


async def test_running_agent_reports_bad_secrets_and_keeps_running(
    harness: OSCAgent, tmp_path: Path
) -> None:
    node = harness.node
    agent = AgentProcess(harness, tmp_path / "agent.log")
    state = "/var/lib/gardener-node-agent"
    try:
        checksum = await harness.publish(limits_osc())
        await agent.start()
        await harness.wait_applied(checksum)
        before = {
            path: node.path(path).read_bytes()
            for path in ("/etc/limits/a.conf", f"{state}/inventory.json", f"{state}/status.json")
        }

        for label, body, needle in bad_secrets():
            await harness.publish(body)
            message = await reported_invalid(harness, agent, needle, label)
            assert "\n" not in message, label
            assert (await harness.node_annotations())["checksum/cloud-config-data"] == checksum
            assert {p: node.path(p).read_bytes() for p in before} == before, label
        assert not node.path("/d").exists()

        # The agent is still at work: a good update applies.
        checksum = await harness.publish(limits_osc(data="a2\n"))
        await harness.wait_applied(checksum)
        assert node.path("/etc/limits/a.conf").read_text() == "a2\n"
        assert await agent.terminate() == 0, agent.log_tail()
    finally:
        await agent.kill()
