"""``node-agent fleet`` (also ``kubectl node-agent``): the pools of a cluster as their agents report
them, one screen per pool.

It reads only what the agents already publish, with one paginated list per kind and no request
per node: Nodes (the applied checksum, the ``OSCRollout`` and ``SystemdUnitsReady`` conditions,
the pool and Kubernetes version labels), the OSC Secrets' metadata (their checksum and rollout
annotations; never their data), the Leases in ``kube-system`` (each agent's heartbeat and each
pool's rollout ledger) and the agents' Events on Nodes.

The ledger, the rollout annotations and the serial Lease are the wire format of
``node_agent.controllers.osc.pacing``, and they are read here with pacing's own pure readers
(the same caps, refusals and defaults as the agents'), never with a second reader of the view's.

Three parts: the pure model (:func:`classify` decides one node's state, :func:`summarize` turns
the listed objects into a :class:`FleetReport`), the rendering (text with a progress bar, or a
JSON/YAML document), and :func:`run_fleet` (lists, ``--watch``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from node_agent.base.durations import human_duration
from node_agent.base.text import escape_controls
from node_agent.controllers.osc import pacing
from node_agent.kube import report

if TYPE_CHECKING:
    from node_agent.kube.client import KubeClient, Resource

JSON = dict[str, Any]

# -- what the agents publish (names as the agent writes them) -------------------------------------

LABEL_POOL = "worker.gardener.cloud/pool"
LABEL_ROLE = "gardener.cloud/role"
ROLE_OSC = "operating-system-config"
#: the agent's heartbeat Lease is ``gardener-node-agent-<node>``
LEASE_PREFIX = "gardener-node-agent-"


WAITING_REASONS = frozenset(
    {pacing.REASON_SERIAL, pacing.REASON_SLOT, pacing.REASON_CANARIES, pacing.REASON_BREAKER}
)
#: Warning Events that say an apply did not succeed
FAILURE_EVENTS = frozenset(
    {report.REASON_OSC_FAILED, report.REASON_OSC_INVALID, *report.REASON_UNIT_COMMAND.values()}
)
#: what a unit held by the restart-storm guard says in the SystemdUnitsReady message
HELD_MARK = "node-agent stopped restarting it"

#: A rollback younger than this reads as "rolled back" (news: look now); an older one as
#: "quarantined" (the node stays on its last-known-good OSC until the Secret changes).
RECENT_ROLLBACK = 600.0
PAGE = 500

State = Literal[
    "up-to-date",
    "applying",
    "waiting",
    "rolled-back",
    "quarantined",
    "failed",
    "not-reporting",
    "unknown",
]
STATES: tuple[State, ...] = get_args(State)
LABELS: Mapping[str, str] = {
    "up-to-date": "up to date",
    "applying": "applying",
    "waiting": "waiting for a slot",
    "rolled-back": "rolled back",
    "quarantined": "quarantined",
    "failed": "failed",
    "not-reporting": "not reporting",
    "unknown": "no OSC known",
}


# -- small readers --------------------------------------------------------------------------------


def _part(obj: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``obj[key]`` when it is an object, else empty (what an API object lacks reads as unset)."""
    part = obj.get(key)
    return part if isinstance(part, Mapping) else {}


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return _part(obj, "metadata")


def _strings(obj: Mapping[str, Any], key: str) -> Mapping[str, str]:
    """A map of strings of the metadata (labels, annotations); an entry that is not a string
    reads as unset."""
    entries = _part(_meta(obj), key)
    if all(type(v) is str for v in entries.values()):
        return entries
    return {k: v for k, v in entries.items() if type(v) is str}


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return _strings(obj, "labels")


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return _strings(obj, "annotations")


def parse_time(value: object) -> float | None:
    """An API time (RFC 3339, with or without fraction) as seconds since the epoch."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return moment.timestamp()


def _short(checksum: str | None) -> str:
    return checksum[:12] if checksum else "-"


# -- the pool's rollout: policy and ledger --------------------------------------------------------


def read_policy(annotations: Mapping[str, str]) -> pacing.Policy:
    """The OSC Secret's rollout annotations exactly as the agents follow them (pacing's reader:
    the same caps, refusals and defaults, with what was not understood in ``problems``)."""
    return pacing.parse_policy(annotations)


def policy_mode(policy: pacing.Policy) -> str:
    if policy.pacing is not None:
        return "paced+serial" if policy.serial else "paced"
    return "serial" if policy.serial else "none"


def describe_policy(policy: pacing.Policy) -> str:
    parts = [policy.pacing.describe()] if policy.pacing is not None else []
    if policy.serial:
        parts.append("serial (one node at a time on the pool's Lease)")
    return "; ".join(parts) or "none (every node applies at once)"


@dataclass(frozen=True)
class SlotFact:
    host: str
    checksum: str
    expires_in: float
    canary: bool


@dataclass(frozen=True)
class LedgerFacts:
    """The pool's ledger as the agents would see it now: expired slots freed, and a holder of
    the ledger's checksum that never reported counted as failed (pacing's ``current``)."""

    checksum: str = ""
    slots: tuple[SlotFact, ...] = ()
    canaries: tuple[str, ...] = ()
    healthy: Mapping[str, float] = field(default_factory=dict)
    failed: Mapping[str, str] = field(default_factory=dict)

    def holders(self) -> tuple[str, ...]:
        return tuple(s.host for s in self.slots)


def read_ledger(text: str | None, now: float, ttl: float = pacing.DEFAULT_SLOT_TTL) -> LedgerFacts:
    """The ledger annotation as the agents read it now (pacing's own parser and ``current``,
    with the numbers bounded as a reader that first sees them now believes them, a slot's
    unreadable ttl the pool's ``ttl``); unreadable reads as empty."""
    ledger = pacing.Ledger.load(text)
    if ledger == pacing.Ledger():
        return LedgerFacts()
    seen = pacing.current(ledger, ledger.checksum, now, ttl)
    slots = tuple(
        SlotFact(s.host, s.checksum, s.renewed + s.ttl - now, s.canary) for s in seen.slots
    )
    return LedgerFacts(seen.checksum, slots, seen.canaries, dict(seen.healthy), dict(seen.failed))


def serial_lease_holder(spec: object, now: float) -> str | None:
    """Who holds the pool's serial Lease now, as a waiting agent judges it (pacing's
    ``serial_step``: the holder's duration bounded by the pool's 600 s, a renewal "in the
    future" counted from now); None when an agent would take it."""
    if not isinstance(spec, Mapping):
        return None
    # as seen by a node that holds nothing (no host is named "")
    step = pacing.serial_step(spec, "", now, pacing.SERIAL_LEASE_SECONDS)
    return str(step.holder) if step.action == "wait" and step.holder is not None else None


# -- one node -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConditionFact:
    status: str
    reason: str
    message: str
    since: float | None


@dataclass(frozen=True)
class EventFact:
    reason: str
    type: str
    message: str
    at: float


@dataclass(frozen=True)
class NodeFacts:
    """What one Node and its agent published, as read."""

    name: str
    pool: str
    applied: str | None
    kubernetes_version: str | None = None
    kubelet_version: str | None = None
    secret_name: str | None = None
    rollout: ConditionFact | None = None
    units: ConditionFact | None = None
    #: the heartbeat Lease: last renewal (epoch seconds) and its duration; None: no Lease
    lease_renewed: float | None = None
    lease_duration: float = 40.0
    events: tuple[EventFact, ...] = ()


@dataclass(frozen=True)
class Verdict:
    state: State
    detail: str = ""


def lease_fresh(node: NodeFacts, now: float) -> bool | None:
    """True: renewed within its duration; False: lapsed; None: no Lease."""
    if node.lease_renewed is None:
        return None
    return now - node.lease_renewed <= node.lease_duration


def classify(
    node: NodeFacts,
    desired: str | None,
    ledger: LedgerFacts | None,
    now: float,
    *,
    secret_changed: float | None = None,
) -> Verdict:
    """Where ``node`` stands with the ``desired`` checksum of its OSC Secret.

    In order: an agent whose Lease lapsed (or never existed) is *not reporting* (whatever else
    it last wrote may be stale); a node whose applied checksum is the desired one is *up to
    date*; then the node's latest word about the desired checksum, from the most durable record
    to the least: its ``OSCRollout`` condition, the pool's ledger, its Events (a rollback is
    *rolled back* while recent, *quarantined* after :data:`RECENT_ROLLBACK`; an apply error is
    *failed*); a holder of a slot is *applying* (the ledger is written the moment it takes the
    slot, its condition after); a node in its pool's queue is *waiting*; anything else is
    *applying*.
    ``secret_changed`` (when the Secret was last written) makes older failure Events moot."""
    fresh = lease_fresh(node, now)
    if fresh is None:
        return Verdict("not-reporting", "no heartbeat Lease")
    if not fresh:
        assert node.lease_renewed is not None
        return Verdict(
            "not-reporting", f"Lease last renewed {human_duration(now - node.lease_renewed)} ago"
        )
    if not desired:
        return Verdict("unknown", "no OSC Secret found for its pool")
    if node.applied == desired:
        return Verdict("up-to-date")
    short = desired[:12]

    def rollback(detail: str, at: float | None) -> Verdict:
        recent = at is not None and now - at < RECENT_ROLLBACK
        return Verdict("rolled-back" if recent else "quarantined", detail)

    cond = node.rollout
    if cond is not None and cond.reason == report.REASON_ROLLOUT_FAILED and short in cond.message:
        if "rolled back" in cond.message:
            return rollback(cond.message, cond.since)
        return Verdict("failed", cond.message)
    rolled_back = [
        e
        for e in node.events
        if e.reason == report.REASON_OSC_ROLLED_BACK and f"OSC {short} " in e.message
    ]
    if rolled_back:
        latest = max(rolled_back, key=lambda e: e.at)
        return rollback(latest.message, latest.at)
    if ledger is not None and ledger.checksum == desired and node.name in ledger.failed:
        why = ledger.failed[node.name]
        if why.startswith("rolled back"):
            return rollback(why, None)
        return Verdict("failed", why)
    outcomes = [
        e
        for e in node.events
        if e.reason == report.REASON_OSC_APPLIED
        or (e.reason in FAILURE_EVENTS and e.type == "Warning")
    ]
    if outcomes:
        latest = max(outcomes, key=lambda e: e.at)
        current = secret_changed is None or latest.at >= secret_changed
        if latest.reason != report.REASON_OSC_APPLIED and current:
            return Verdict("failed", f"{latest.reason}: {latest.message}")
    if ledger is not None and node.name in ledger.holders():
        # the ledger is written the moment a node takes its slot; its condition follows
        return Verdict("applying", "holds a rollout slot")
    if cond is not None and cond.status == "False" and cond.reason in WAITING_REASONS:
        return Verdict("waiting", f"{cond.reason}: {cond.message}")
    if cond is not None and cond.reason == report.REASON_ROLLOUT_APPLYING and cond.status == "True":
        return Verdict("applying", cond.message)
    return Verdict("applying", f"applied {_short(node.applied)}, desired {short}")


def unit_problems(units: ConditionFact | None) -> tuple[tuple[str, str], ...]:
    """(unit, what) for each unit a ``False`` SystemdUnitsReady names (``"<unit>: <what>"``
    entries joined with ``"; "``)."""
    if units is None or units.status != "False":
        return ()
    found = []
    for entry in units.message.split("; "):
        unit, sep, what = entry.partition(": ")
        if sep and unit and " " not in unit:
            found.append((unit, what))
    return tuple(found)


# -- the report -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeLine:
    name: str
    state: State
    applied: str | None
    detail: str


@dataclass(frozen=True)
class PoolReport:
    name: str
    secrets: tuple[tuple[str, str | None], ...]  # (name, checksum)
    desired: str | None
    policy: pacing.Policy
    ledger: LedgerFacts | None
    serial_holder: str | None
    nodes: tuple[NodeLine, ...]
    applied: Mapping[str, int]
    units_not_ready: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    held_units: Mapping[str, tuple[str, ...]]
    leases: Mapping[str, Any]
    kubernetes_versions: Mapping[str, int]
    kubelet_versions: Mapping[str, int]

    @property
    def states(self) -> dict[str, int]:
        counts = Counter(n.state for n in self.nodes)
        return {s: counts.get(s, 0) for s in STATES}

    @property
    def done(self) -> bool:
        return all(n.state == "up-to-date" for n in self.nodes)

    def breaker(self) -> tuple[bool, str]:
        """Open?, and why (the failures of the ledger's checksum, against the limit)."""
        ledger = self.ledger
        pace = self.policy.pacing
        if pace is None or ledger is None or not ledger.checksum:
            return False, ""
        failed = len(ledger.failed)
        limit = pace.max_failures
        why = "; ".join(f"{h}: {w}" for h, w in sorted(ledger.failed.items()))
        return failed >= limit, f"{failed}/{limit} failures" + (f": {why}" if why else "")


@dataclass(frozen=True)
class FleetReport:
    at: float
    pools: tuple[PoolReport, ...]
    #: API requests this snapshot took, the pages read and the items listed, per resource
    requests: int = 0
    pages: Mapping[str, int] = field(default_factory=dict)
    listed: Mapping[str, int] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return all(p.done for p in self.pools)


def _condition(node: Mapping[str, Any], kind: str) -> ConditionFact | None:
    conditions = _part(node, "status").get("conditions")
    for cond in conditions if isinstance(conditions, list) else []:
        if isinstance(cond, Mapping) and cond.get("type") == kind:
            return ConditionFact(
                str(cond.get("status") or ""),
                str(cond.get("reason") or ""),
                str(cond.get("message") or ""),
                parse_time(cond.get("lastTransitionTime")),
            )
    return None


def _event_time(event: Mapping[str, Any]) -> float:
    for key in ("lastTimestamp", "eventTime", "firstTimestamp"):
        at = parse_time(event.get(key))
        if at is not None:
            return at
    return parse_time(_meta(event).get("creationTimestamp")) or 0.0


def _changed_at(obj: Mapping[str, Any]) -> float | None:
    """When an object was last written: its newest managedFields entry, else its creation."""
    meta = _meta(obj)
    times = [
        parse_time(m.get("time")) for m in meta.get("managedFields") or [] if isinstance(m, Mapping)
    ]
    known = [t for t in times if t is not None]
    return max(known) if known else parse_time(meta.get("creationTimestamp"))


def node_facts(
    node: Mapping[str, Any],
    leases: Mapping[str, Mapping[str, Any]],
    events: Mapping[str, Sequence[EventFact]],
) -> NodeFacts:
    name = str(_meta(node).get("name") or "")
    labels = _labels(node)
    lease = leases.get(LEASE_PREFIX + name)
    renewed = duration = None
    if lease is not None:
        spec = _part(lease, "spec")
        renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
        seconds = spec.get("leaseDurationSeconds")
        duration = float(seconds) if isinstance(seconds, int | float) and seconds > 0 else None
        if renewed is None:
            renewed = 0.0  # a Lease never renewed: lapsed
    info = _part(_part(node, "status"), "nodeInfo")
    return NodeFacts(
        name=name,
        pool=str(labels.get(LABEL_POOL) or ""),
        applied=_annotations(node).get(report.ANNOTATION_APPLIED_CHECKSUM) or None,
        kubernetes_version=labels.get(report.LABEL_KUBERNETES_VERSION) or None,
        kubelet_version=str(info.get("kubeletVersion") or "") or None,
        secret_name=labels.get(report.LABEL_SECRET_NAME) or None,
        rollout=_condition(node, report.CONDITION_ROLLOUT),
        units=_condition(node, report.CONDITION_UNITS_READY),
        lease_renewed=renewed,
        lease_duration=duration or 40.0,
        events=tuple(events.get(name, ())),
    )


def _is_agent_node(node: Mapping[str, Any], leases: Mapping[str, Any]) -> bool:
    name = str(_meta(node).get("name") or "")
    return (
        LABEL_POOL in _labels(node)
        or report.ANNOTATION_APPLIED_CHECKSUM in _annotations(node)
        or (LEASE_PREFIX + name) in leases
    )


def summarize(
    nodes: Iterable[Mapping[str, Any]],
    secrets: Iterable[Mapping[str, Any]],
    leases: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    now: float,
    *,
    pools: Sequence[str] = (),
    requests: int = 0,
) -> FleetReport:
    """The fleet report from the listed objects (pure: no I/O)."""
    lease_by_name = {str(_meta(lease).get("name")): lease for lease in leases}
    by_node: dict[str, list[EventFact]] = {}
    for event in events:
        involved = _part(event, "involvedObject")
        if involved.get("kind") != "Node":
            continue
        by_node.setdefault(str(involved.get("name") or ""), []).append(
            EventFact(
                str(event.get("reason") or ""),
                str(event.get("type") or ""),
                str(event.get("message") or ""),
                _event_time(event),
            )
        )
    secret_by_name: dict[str, Mapping[str, Any]] = {}
    pool_secrets: dict[str, list[Mapping[str, Any]]] = {}
    for secret in secrets:
        name = str(_meta(secret).get("name") or "")
        secret_by_name[name] = secret
        pool_secrets.setdefault(str(_labels(secret).get(LABEL_POOL) or ""), []).append(secret)
    grouped: dict[str, list[NodeFacts]] = {}
    for node in nodes:
        if not _is_agent_node(node, lease_by_name):
            continue
        facts = node_facts(node, lease_by_name, by_node)
        grouped.setdefault(facts.pool, []).append(facts)
    names = sorted(set(grouped) | ({p for p in pool_secrets if p} if not pools else set(pools)))
    if pools:
        names = [p for p in names if p in pools]
    reports = []
    for pool in names:
        own = sorted(
            pool_secrets.get(pool, []),
            key=lambda s: (_changed_at(s) or 0.0, str(_meta(s).get("name"))),
        )
        reports.append(
            _pool_report(pool, grouped.get(pool, []), own, secret_by_name, lease_by_name, now)
        )
    return FleetReport(now, tuple(reports), requests)


def _pool_report(
    pool: str,
    nodes: Sequence[NodeFacts],
    secrets: Sequence[Mapping[str, Any]],
    secret_by_name: Mapping[str, Mapping[str, Any]],
    leases: Mapping[str, Mapping[str, Any]],
    now: float,
) -> PoolReport:
    newest = secrets[-1] if secrets else None
    pool_desired = _annotations(newest).get(report.ANNOTATION_SECRET_CHECKSUM) if newest else None
    policy = read_policy(_annotations(newest)) if newest else pacing.Policy()
    pool_lease = leases.get(str(_meta(newest).get("name"))) if newest else None
    ledger = None
    serial_holder = None
    if pool_lease is not None:
        ttl = policy.pacing.slot_ttl if policy.pacing is not None else pacing.DEFAULT_SLOT_TTL
        ledger = read_ledger(_annotations(pool_lease).get(pacing.ANNOTATION_LEDGER), now, ttl)
        if policy.serial:
            serial_holder = serial_lease_holder(pool_lease.get("spec"), now)
    lines: list[NodeLine] = []
    units: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    held: dict[str, list[str]] = {}
    lease_ages: list[float] = []
    lease_counts = Counter[str]()
    for node in sorted(nodes, key=lambda n: n.name):
        secret = secret_by_name.get(node.secret_name or "") if node.secret_name else None
        chosen = secret if secret is not None else newest
        desired = _annotations(chosen).get(report.ANNOTATION_SECRET_CHECKSUM) if chosen else None
        changed = _changed_at(chosen) if chosen else None
        verdict = classify(node, desired, ledger, now, secret_changed=changed)
        lines.append(NodeLine(node.name, verdict.state, node.applied, verdict.detail))
        problems = unit_problems(node.units)
        if problems:
            units.append((node.name, problems))
        for unit, what in problems:
            if HELD_MARK in what:
                held.setdefault(unit, []).append(node.name)
        fresh = lease_fresh(node, now)
        lease_counts["missing" if fresh is None else "fresh" if fresh else "stale"] += 1
        if node.lease_renewed is not None:
            lease_ages.append(max(0.0, now - node.lease_renewed))
    leases_doc: dict[str, Any] = {k: lease_counts.get(k, 0) for k in ("fresh", "stale", "missing")}
    leases_doc["oldestRenewalSeconds"] = round(max(lease_ages), 1) if lease_ages else None
    return PoolReport(
        name=pool,
        secrets=tuple(
            (str(_meta(s).get("name")), _annotations(s).get(report.ANNOTATION_SECRET_CHECKSUM))
            for s in secrets
        ),
        desired=pool_desired,
        policy=policy,
        ledger=ledger,
        serial_holder=serial_holder,
        nodes=tuple(lines),
        applied=dict(Counter(n.applied or "" for n in nodes).most_common()),
        units_not_ready=tuple(units),
        held_units={u: tuple(sorted(ns)) for u, ns in sorted(held.items())},
        leases=leases_doc,
        kubernetes_versions=dict(Counter(n.kubernetes_version or "" for n in nodes).most_common()),
        kubelet_versions=dict(Counter(n.kubelet_version or "" for n in nodes).most_common()),
    )


# -- rendering ------------------------------------------------------------------------------------


def to_document(pools_report: FleetReport) -> JSON:
    """The report as a JSON/YAML document (``-o json|yaml``)."""
    return {
        "at": pools_report.at,
        "requests": pools_report.requests,
        "pages": dict(pools_report.pages),
        "listed": dict(pools_report.listed),
        "done": pools_report.done,
        "pools": [_pool_document(p) for p in pools_report.pools],
    }


def _pool_document(pool: PoolReport) -> JSON:
    open_, why = pool.breaker()
    ledger = pool.ledger
    pace = pool.policy.pacing
    unit_counts = Counter(u for _, problems in pool.units_not_ready for u, _ in problems)
    return {
        "name": pool.name,
        "secrets": [{"name": n, "checksum": c} for n, c in pool.secrets],
        "desired": pool.desired,
        "nodes": len(pool.nodes),
        "states": pool.states,
        "applied": pool.applied,
        "rollout": {
            "mode": policy_mode(pool.policy),
            "policy": describe_policy(pool.policy),
            "maxParallel": pace.max_parallel if pace else None,
            "canaries": pace.canaries if pace else pacing.DEFAULT_CANARIES,
            "maxFailures": pace.max_failures if pace else pacing.DEFAULT_MAX_FAILURES,
            "problems": list(pool.policy.problems),
            "serialHolder": pool.serial_holder,
            "ledger": None
            if ledger is None
            else {
                "checksum": ledger.checksum or None,
                "slots": [
                    {
                        "host": s.host,
                        "checksum": s.checksum,
                        "canary": s.canary,
                        "expiresInSeconds": round(s.expires_in, 1),
                    }
                    for s in ledger.slots
                ],
                "canaries": list(ledger.canaries),
                "healthy": len(ledger.healthy),
                "failed": dict(sorted(ledger.failed.items())),
            },
            "breakerOpen": open_,
            "breaker": why or None,
        },
        "unitsNotReady": {
            "units": dict(unit_counts.most_common()),
            "nodes": [
                {"name": n, "units": [{"unit": u, "message": m} for u, m in problems]}
                for n, problems in pool.units_not_ready
            ],
        },
        "heldUnits": {u: list(ns) for u, ns in pool.held_units.items()},
        "leases": dict(pool.leases),
        "versions": {
            "kubernetes": dict(pool.kubernetes_versions),
            "kubelet": dict(pool.kubelet_versions),
        },
        "nodeStates": [
            {"name": n.name, "state": n.state, "applied": n.applied, "detail": n.detail}
            for n in pool.nodes
        ],
    }


def progress_bar(done: int, total: int, width: int = 40) -> str:
    filled = 0 if total == 0 else round(width * done / total)
    percent = 100 if total == 0 else int(100 * done / total)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} up to date ({percent}%)"


def _counts(counts: Mapping[str, int], *, label: Mapping[str, str] | None = None) -> str:
    return ", ".join(f"{(label or {}).get(k, k or '-')} {v}" for k, v in counts.items()) or "-"


def render(pools_report: FleetReport, *, max_nodes: int = 20) -> str:
    """The text screen: one block per pool. Every string in it came from the cluster, where
    any node's agent may write it (names, checksums, messages, the Lease's holder, the
    ledger's hosts): each line is shown with its control characters escaped, as ``status``
    shows them, so none of them drives the terminal. ``dump`` keeps them exact."""
    if not pools_report.pools:
        return "no node-agent pools found (no Nodes with an agent, no OSC Secrets)\n"
    return "\n".join(_render_pool(p, max_nodes) for p in pools_report.pools)


def _render_pool(pool: PoolReport, max_nodes: int) -> str:
    out: list[str] = []
    secrets = ", ".join(f"{n} ({_short(c)})" for n, c in pool.secrets) or "none found"
    out.append(f"pool {pool.name or '(no pool label)'}: OSC Secret {secrets}")
    states = pool.states
    shown = {LABELS[s]: c for s, c in states.items() if c or s != "unknown"}
    out.append(f"  nodes {len(pool.nodes)}: {_counts(shown)}")
    out.append("  " + progress_bar(states["up-to-date"], len(pool.nodes)))
    applied = {
        (f"{_short(c)} (desired)" if c and c == pool.desired else _short(c or None)): n
        for c, n in pool.applied.items()
    }
    out.append(f"  desired {_short(pool.desired)}; applied: {_counts(applied)}")
    out.append(f"  rollout: {describe_policy(pool.policy)}")
    if pool.policy.problems:
        out.append(f"    annotations as the agents read them: {'; '.join(pool.policy.problems)}")
    if pool.serial_holder:
        out.append(f"    serial Lease held by {pool.serial_holder}")
    ledger = pool.ledger
    pace = pool.policy.pacing
    if pace is not None and ledger is not None and ledger.checksum:
        slots = ", ".join(
            f"{s.host}{' (canary)' if s.canary else ''} {human_duration(s.expires_in)} left"
            for s in ledger.slots
        )
        out.append(
            f"    ledger {_short(ledger.checksum)}: slots {len(ledger.slots)}/"
            f"{pace.max_parallel}{': ' + slots if slots else ''}"
        )
        out.append(
            f"    canaries: {', '.join(ledger.canaries) or '-'}; "
            f"canaries healthy {len(ledger.healthy)}; "
            f"failed {len(ledger.failed)}"
        )
        open_, why = pool.breaker()
        out.append(f"    breaker {'OPEN' if open_ else 'closed'}: {why}")
    if pool.units_not_ready:
        counts = Counter(u for _, problems in pool.units_not_ready for u, _ in problems)
        out.append(
            f"  SystemdUnitsReady False on {len(pool.units_not_ready)} node(s): "
            + ", ".join(f"{u} {c}" for u, c in counts.most_common())
        )
        for name, problems in pool.units_not_ready[:max_nodes]:
            out.append(f"    {name}: " + "; ".join(f"{u}: {m}" for u, m in problems))
    for unit, holders in pool.held_units.items():
        out.append(f"  restart-storm guard holds {unit} on {len(holders)}: {', '.join(holders)}")
    leases = pool.leases
    oldest = leases.get("oldestRenewalSeconds")
    out.append(
        f"  Leases: {leases['fresh']} fresh, {leases['stale']} lapsed, {leases['missing']} missing"
        + (f"; oldest renewal {human_duration(float(oldest))} ago" if oldest is not None else "")
    )
    out.append(
        f"  versions: kubernetes {_counts(pool.kubernetes_versions)}; "
        f"kubelet {_counts(pool.kubelet_versions)}"
    )
    behind = [n for n in pool.nodes if n.state != "up-to-date"]
    if behind:
        out.append(f"  not up to date ({len(behind)}):")
        names = [escape_controls(n.name) for n in behind[:max_nodes]]
        width = max(len(name) for name in names)
        for name, line in zip(names, behind[:max_nodes], strict=True):
            out.append(f"    {name:<{width}}  {LABELS[line.state]:<18}  {line.detail}")
        if len(behind) > max_nodes:
            out.append(f"    ... {len(behind) - max_nodes} more (-o json lists every node)")
    return "".join(escape_controls(line) + "\n" for line in out)


def dump(pools_report: FleetReport, output: str) -> str:
    doc = to_document(pools_report)
    if output == "yaml":
        import yaml

        return str(yaml.safe_dump(doc, sort_keys=False))
    return json.dumps(doc, indent=2) + "\n"


# -- reading the cluster --------------------------------------------------------------------------


async def list_all(
    resource: Resource, *, page: int = PAGE, pages: dict[str, int] | None = None, **selectors: Any
) -> list[JSON]:
    """Every item of a collection, ``page`` at a time (``limit``/``continue``); the pages read
    are counted in ``pages`` under the resource's name."""
    items: list[JSON] = []
    token: str | None = None
    while True:
        answer = await resource.list(limit=page, continue_token=token, **selectors)
        if pages is not None:
            pages[resource.plural] = pages.get(resource.plural, 0) + 1
        items.extend(i for i in answer.get("items") or [] if isinstance(i, dict))
        token = (answer.get("metadata") or {}).get("continue") or None
        if not token:
            return items


async def collect(
    kube: KubeClient, pools: Sequence[str] = (), *, page: int = PAGE, now: float | None = None
) -> FleetReport:
    """One snapshot: four paginated lists, run side by side."""
    node_selector = f"{LABEL_POOL} in ({','.join(pools)})" if pools else None
    secret_selector = f"{LABEL_ROLE}={ROLE_OSC}"
    if pools:
        secret_selector += f",{LABEL_POOL} in ({','.join(pools)})"
    pages: dict[str, int] = {}
    before = kube.stats.requests
    nodes, secrets, leases, events = await asyncio.gather(
        list_all(kube.nodes(), page=page, pages=pages, label_selector=node_selector),
        list_all(
            kube.secrets(report.NAMESPACE),
            page=page,
            pages=pages,
            label_selector=secret_selector,
            metadata_only=True,
        ),
        list_all(kube.leases(report.NAMESPACE), page=page, pages=pages),
        list_all(
            kube.events(report.EVENT_NAMESPACE),
            page=page,
            pages=pages,
            field_selector=f"involvedObject.kind=Node,source={report.COMPONENT}",
        ),
    )
    pools_report = summarize(
        nodes,
        secrets,
        leases,
        events,
        time.time() if now is None else now,
        pools=pools,
        requests=kube.stats.requests - before,
    )
    listed = {"nodes": len(nodes), "secrets": len(secrets), "leases": len(leases)}
    listed["events"] = len(events)
    return replace(pools_report, pages=pages, listed=listed)


def kubeconfig_path(flag: str | None) -> Path:
    """``--kubeconfig``, else the first file of ``$KUBECONFIG``, else ``~/.kube/config``."""
    if flag:
        return Path(flag)
    env = os.environ.get("KUBECONFIG", "")
    for entry in env.split(os.pathsep):
        if entry:
            return Path(entry)
    return Path.home() / ".kube" / "config"


CLEAR = "\x1b[H\x1b[2J"


async def run_fleet(
    kubeconfig: Path,
    pools: Sequence[str],
    *,
    output: str = "text",
    watch: bool = False,
    interval: float = 5.0,
    max_nodes: int = 20,
) -> int:
    """Print the fleet once, or (``watch``) again every ``interval`` seconds until every node of
    the chosen pools is up to date. Raises ``KubeError`` on API trouble."""
    from node_agent.kube.client import KubeClient

    async with KubeClient.from_kubeconfig(kubeconfig) as kube:
        while True:
            pools_report = await collect(kube, pools)
            if output == "text":
                text = render(pools_report, max_nodes=max_nodes)
                if watch and sys.stdout.isatty():
                    text = CLEAR + text
                sys.stdout.write(text)
            elif watch and output == "json":
                sys.stdout.write(json.dumps(to_document(pools_report)) + "\n")
            else:
                sys.stdout.write(dump(pools_report, output))
            sys.stdout.flush()
            if not watch or pools_report.done:
                return 0
            await asyncio.sleep(interval)
