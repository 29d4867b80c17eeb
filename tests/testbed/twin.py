"""The differential twin: what one node looks like after an OSC, for comparing two agents.

Two throwaway nodes of the same shape get the same OSC bytes, one run by upstream
gardener-node-agent, the other by node-agent. ``NodeView`` is what either one left behind that
Gardener's contract covers (OSC files, unit files and drop-ins, unit states, containerd's
configuration, the Node object, the Events); ``compare`` lines two views up item by item.
"""

from __future__ import annotations

import hashlib
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.systemd_ns import IsolatedSystemd

#: upstream's own unit, written by the test for the upstream twin only (node-agent's twin runs
#: in the test's process): not part of what the OSC asks for
AGENT_UNIT = "gardener-node-agent.service"
#: what an OSC item of the agent itself names; the twins keep their own agent (see ``strip_agent``)
AGENT_PATHS = ("/opt/bin/gardener-node-agent", "/var/lib/gardener-node-agent/")

#: the unit properties compared; InvocationID only tells whether a unit started again
UNIT_PROPS = ("LoadState", "UnitFileState", "ActiveState", "SubState", "InvocationID")

#: trees compared whole (every file: bytes, mode, owner; every symlink: its target)
TREES = ("/etc/systemd/system", "/etc/containerd")

#: the component the real kubelet records its Events as
KUBELET_COMPONENT = "kubelet"
#: Node labels that name the node itself
NODE_NAME_LABELS = ("kubernetes.io/hostname",)
#: how a health-check Event of upstream's ends when the probe's context was cancelled (by the
#: agent's own shutdown, e.g. the self-restart after an update of its unit): the Event names
#: containerd or kubelet, but only the timing of the restart decided it (Gardener v1.145/v1.146
#: restarted itself late enough in a reconcile for a probe to be in flight: once each in a
#: `make compat` run, not on a rerun)
CANCELLED_PROBE = "context canceled"


def strip_agent(osc: dict[str, Any]) -> dict[str, Any]:
    """The OSC without the agent's own unit, binary and config file.

    Each twin keeps the agent it was started with: with them, upstream would replace itself by
    Gardener's image (unreachable from the bed) and node-agent's twin would get upstream's
    binary. Everything else of Gardener's OSC stays as generated."""
    spec = osc["spec"]
    spec["files"] = [
        f for f in spec["files"] if not any(f["path"].startswith(p) for p in AGENT_PATHS)
    ]
    spec["units"] = [u for u in spec["units"] if u["name"] != AGENT_UNIT]
    return osc


def osc_bytes(osc: Mapping[str, Any]) -> bytes:
    return yaml.safe_dump(dict(osc), sort_keys=False).encode()


@dataclass
class NodeView:
    items: dict[str, str] = field(default_factory=dict)
    invocations: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, value: str) -> None:
        self.items[key] = value


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def file_item(node: IsolatedSystemd, path: str) -> str:
    target = node.path(path)
    try:
        st = target.lstat()
    except FileNotFoundError:
        return "absent"
    if stat.S_ISLNK(st.st_mode):
        return f"symlink -> {target.readlink()}"
    if stat.S_ISDIR(st.st_mode):
        return f"dir {oct(st.st_mode & 0o7777)} {st.st_uid}:{st.st_gid}"
    return (
        f"{_digest(target.read_bytes())} {oct(st.st_mode & 0o7777)} {st.st_uid}:{st.st_gid} "
        f"{st.st_size}B"
    )


def tree_paths(node: IsolatedSystemd, top: str) -> list[str]:
    """Every path below ``top`` inside the node, as node paths."""
    base = node.path(top)
    if not base.is_dir():
        return []
    return sorted("/" + str(p.relative_to(node.root)) for p in base.rglob("*"))


def unit_states(node: IsolatedSystemd, units: Iterable[str]) -> dict[str, dict[str, str]]:
    """systemd's view of the units (a template, ``foo@.service``, has none: systemd refuses
    to show a bare template name, and the whole call with it)."""
    names = sorted(u for u in set(units) if not u.endswith("@.service"))
    if not names:
        return {}
    out = node.run(["systemctl", "show", "-p", "Id," + ",".join(UNIT_PROPS), *names]).stdout
    states: dict[str, dict[str, str]] = {}
    for name, block in zip(names, out.strip().split("\n\n"), strict=False):
        states[name] = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
    return states


def osc_units(osc: Mapping[str, Any]) -> list[str]:
    units = [str(u["name"]) for u in osc["spec"].get("units") or []]
    status = osc.get("status") or {}
    units += [str(u["name"]) for u in status.get("extensionUnits") or []]
    return units


def osc_paths(osc: Mapping[str, Any]) -> list[str]:
    paths = [str(f["path"]) for f in osc["spec"].get("files") or []]
    status = osc.get("status") or {}
    paths += [str(f["path"]) for f in status.get("extensionFiles") or []]
    return paths


async def node_view(
    admin: ApiClient,
    node: IsolatedSystemd,
    node_name: str,
    *,
    paths: Iterable[str],
    units: Iterable[str],
    exclude_trees: Iterable[str] = (),
) -> NodeView:
    """What the node and its Node object look like now, keyed the same on both twins."""
    view = NodeView()
    excluded = tuple(exclude_trees)
    for path in sorted(set(paths)):
        view.add(f"file {path}", file_item(node, path))
    for top in TREES:
        for path in tree_paths(node, top):
            if path.startswith(excluded):
                continue
            view.add(f"tree {path}", file_item(node, path))
    for name, props in unit_states(node, units).items():
        for prop in UNIT_PROPS[:-1]:
            view.add(f"unit {name} {prop}", props.get(prop, ""))
        view.invocations[name] = props.get("InvocationID", "")
    api = client.CoreV1Api(admin)
    obj = await api.read_node(node_name)
    for key, value in sorted((obj.metadata.annotations or {}).items()):
        view.add(f"node annotation {key}", value)
    for key, value in sorted((obj.metadata.labels or {}).items()):
        if key in NODE_NAME_LABELS:
            continue
        view.add(f"node label {key}", value)
    for cond in (obj.status.conditions or []) if obj.status else []:
        view.add(f"node condition {cond.type}", f"{cond.status} {cond.reason}")
        view.add(f"node condition {cond.type} message", str(cond.message))
    events = await api.list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node_name}"
    )
    # a health probe cut short by its own agent's shutdown ("... context canceled": upstream
    # records it as unhealthiness when it restarts itself mid-probe) says nothing of the node
    seen = [
        e
        for e in events.items
        if not str(e.message or "").endswith(CANCELLED_PROBE) and not _kubelets(e)
    ]
    for reason in sorted({str(e.reason) for e in seen}):
        types = sorted({str(e.type) for e in seen if e.reason == reason})
        view.add(f"node event {reason}", ",".join(types))
    return view


def _kubelets(event: Any) -> bool:
    """An Event the real kubelet itself recorded (its start, its status changes, its image
    file system): both twins' kubelets record the same ones, at moments that depend on their
    own checks' timing, not on an agent (the agents' restarts of it are compared by unit)."""
    source = getattr(event, "source", None)
    components = {getattr(source, "component", None), getattr(event, "reporting_component", None)}
    return KUBELET_COMPONENT in components


async def event_messages(admin: ApiClient, node_name: str) -> list[str]:
    """The Events about the Node as ``reason: message`` (for the report of a difference)."""
    events = await client.CoreV1Api(admin).list_namespaced_event(
        "default", field_selector=f"involvedObject.name={node_name}"
    )
    return sorted({f"{e.type} {e.reason}: {e.message}" for e in events.items})


def restarted(before: NodeView, after: NodeView) -> set[str]:
    """The units whose InvocationID changed (started, restarted, or stopped)."""
    return {
        name
        for name, inv in after.invocations.items()
        if inv and inv != before.invocations.get(name, "")
    }


@dataclass(frozen=True)
class Known:
    """A documented difference: why node-agent differs, and optionally the one part of
    node-agent's value that may differ: without it, node-agent's value must be upstream's (so
    that only that difference is accepted, not any other)."""

    why: str
    ours_extra: str = ""

    def accepts(self, upstream: str, ours: str) -> bool:
        return not self.ours_extra or (
            self.ours_extra in ours and ours.replace(self.ours_extra, "") == upstream
        )


@dataclass(frozen=True)
class Row:
    key: str
    upstream: str
    ours: str
    verdict: str  # "same", "differs", or "known: <why>"


def compare(
    upstream: NodeView,
    ours: NodeView,
    known: Mapping[str, Known],
) -> list[Row]:
    """Every key of either view, side by side; a key in ``known`` (a documented difference,
    matched as a prefix, with node-agent's value containing the given text) is reported with
    its reason instead of as a difference."""
    rows = []
    for key in sorted(set(upstream.items) | set(ours.items)):
        up = upstream.items.get(key, "-")
        na = ours.items.get(key, "-")
        if up == na:
            verdict = "same"
        else:
            reason = next(
                (
                    k.why
                    for prefix, k in known.items()
                    if key.startswith(prefix) and k.accepts(up, na)
                ),
                None,
            )
            verdict = f"known: {reason}" if reason else "differs"
        rows.append(Row(key, up, na, verdict))
    return rows


def table(step: str, rows: list[Row], *, all_rows: bool = False) -> str:
    """The comparison as text: differences in full, the equal items counted."""
    same = sum(1 for r in rows if r.verdict == "same")
    lines = [f"== step {step}: {same} same, {len(rows) - same} not"]
    for r in rows:
        if r.verdict != "same" or all_rows:
            lines.append(f"  {r.verdict:.70} | {r.key} | upstream: {r.upstream} | ours: {r.ours}")
    return "\n".join(lines)
