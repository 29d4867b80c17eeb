"""Rollout coordination of a worker pool: the pure decisions, no I/O.

Two mechanisms, both asked for by annotations of the OSC Secret and both kept in the one Lease a
node agent may write besides its own heartbeat: ``kube-system/<secretName>``.

- **Serial mode** (Gardener's ``reconciliation.osc.node-agent.gardener.cloud/serial: "true"``):
  the Lease's ``spec`` is a leader election of the nodes applying an update. :func:`serial_step`
  decides as Gardener's agent does: take it when nobody holds it or the holder let it lapse
  (``renewTime + leaseDurationSeconds`` passed), else wait until it expires.
- **Paced rollout** (our own, ``node-agent.gardener.cloud/rollout-*``): at most K nodes apply a
  disruptive change at once, the first C are canaries the rest wait for (applied, healthy, and
  a soak period over), and a circuit breaker holds the pool once F nodes failed the same
  checksum. The state is a :class:`Ledger` in one annotation of that Lease, written with
  compare-and-swap; :func:`decide` and :func:`finish` compute the next ledger.

Times are seconds since the epoch, but a time another node wrote is not trusted beyond
:data:`CLOCK_SKEW` ahead of the reader: a renewal "in the future" counts as made when this reader
first saw it (:class:`Sightings`), so a slot or a serial Lease expires at most its (bounded) ttl
after this reader last saw it change, whatever the writer's clock or numbers say. Gardener's
serial Lease trusts the writer's ``renewTime``: a holder that wrote a year-9999 time and died
would hold the pool for ever. Every number read from the Lease is bounded the same way (ttl,
times, counts), and a ledger that cannot be read is reset with a problem to report.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Literal, TypeGuard

from node_agent.base.durations import parse_duration
from node_agent.kube.report import ANNOTATION_SERIAL

PREFIX = "node-agent.gardener.cloud/"
#: K: how many nodes of the pool may apply a disruptive change at once; setting it turns pacing on
ANNOTATION_MAX_PARALLEL = PREFIX + "rollout-max-parallel"
#: C: the first C nodes are canaries (default 0: none)
ANNOTATION_CANARIES = PREFIX + "rollout-canaries"
#: how long the canaries must stay healthy after their apply before the rest follows
ANNOTATION_SOAK = PREFIX + "rollout-canary-soak"
#: F: failures (or rollbacks, or lost holders) of one checksum that trip the circuit breaker
ANNOTATION_MAX_FAILURES = PREFIX + "rollout-max-failures"
#: how long a slot lives without renewal (its holder renews it while applying)
ANNOTATION_SLOT_TTL = PREFIX + "rollout-slot-ttl"
#: the ledger, on the Lease ``<secretName>`` (JSON)
ANNOTATION_LEDGER = PREFIX + "rollout"

DEFAULT_CANARIES = 0
DEFAULT_SOAK = 600.0
DEFAULT_MAX_FAILURES = 1
DEFAULT_SLOT_TTL = 600.0
#: Gardener's serial Lease: held for 600 s, never renewed while held, released after the apply
SERIAL_LEASE_SECONDS = 600
#: how far ahead of the reader's clock a time written by another node is believed
CLOCK_SKEW = 10.0
#: the longest a slot may live without renewal, whatever the Secret or the ledger says
MAX_SLOT_TTL = 3600.0
#: the longest canary soak the Secret may ask for
MAX_SOAK = 86400.0
#: a ledger listing more entries than this (slots, canaries, results) is not one we wrote
MAX_LEDGER_ENTRIES = 1000
#: how long a free place may stay untaken by the tickets whose turn it is before the next ones in
#: line may pass them over (their holders died or restarted); doubled in reach each period
TICKET_GRACE = 15.0
#: the largest ticket number a ledger may carry (JSON numbers stay exact below it)
MAX_TICKET = 2**53
#: a node without a ticket draws one only while fewer than this many times K tickets wait (or
#: the line stood still for a grace): the rest of the pool watches without writing until the
#: line shortens, so a new Secret costs the pool ~2K draws at once, not N racing on one Lease
JOIN_DEPTH = 2
#: the pool's join window (seconds), as its ledger keeps it: the largest a ledger may carry (a
#: forged one delays joins by at most about this over the pool, then is learned away)
MAX_JOIN_WINDOW = 3600.0
#: how soon after a place in the line came free the first join should land: the window is
#: learned so that the first of the n nodes outside, each drawing its delay in it, writes about
#: this long after the line shortened (see :func:`learn_window`)
JOIN_TARGET = 1.0
#: the most one join may widen the window by, and narrow it by
JOIN_LEARN_STEP = (4.0, 0.5)
#: the largest pool a ledger may name (a Kubernetes cluster's supported size): a forged or
#: garbled count widens the join window at most as far as a pool this large would
MAX_POOL = 5000
#: a place handed by the node that leaves it to the next ticket (:func:`hand_over`) lives this
#: long until its receiver claims it (its first renewal): a receiver that died in line costs the
#: pool at most this, and is not counted by the breaker (it never started)
HANDOFF_TTL = 30.0
#: the receiver of a handed place claims it this long after it started applying, unless its
#: result came first (a short apply writes once: its result)
CLAIM_AFTER = 10.0
#: longest host name / failure reason kept from a ledger
MAX_NAME = 253
MAX_WHY = 300

#: units whose restart makes a change disruptive (the node's workloads notice it)
DISRUPTIVE_UNITS = frozenset({"kubelet.service", "containerd.service"})

Reason = Literal[
    "WaitingForSerialLease", "WaitingForSlot", "WaitingForCanaries", "CircuitBreakerOpen"
]
REASON_SERIAL: Reason = "WaitingForSerialLease"
REASON_SLOT: Reason = "WaitingForSlot"
REASON_CANARIES: Reason = "WaitingForCanaries"
REASON_BREAKER: Reason = "CircuitBreakerOpen"


# -- the policy ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pacing:
    max_parallel: int
    canaries: int = DEFAULT_CANARIES
    soak: float = DEFAULT_SOAK
    max_failures: int = DEFAULT_MAX_FAILURES
    slot_ttl: float = DEFAULT_SLOT_TTL

    def describe(self) -> str:
        return (
            f"at most {self.max_parallel} at once, {self.canaries} canaries "
            f"(soak {self.soak:g}s), breaker after {self.max_failures} failures"
        )


@dataclass(frozen=True)
class Policy:
    serial: bool = False
    pacing: Pacing | None = None
    #: annotations that were set but not understood (their defaults were used)
    problems: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.serial or self.pacing is not None


#: the longest annotation value read as a number or a duration: real ones are a few characters,
#: and the duration parser's time grows with the square of a long run of digits
MAX_VALUE_CHARS = 64


_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")


def _count(annotations: Mapping[str, str], key: str, default: int, low: int) -> tuple[int, str]:
    raw = annotations.get(key)
    if raw is None:
        return default, ""
    text = raw.strip() if _readable(raw) else ""
    # ASCII digits only: int() also takes other scripts' digits and "1_0"
    value = int(text) if _WHOLE_NUMBER.fullmatch(text) else None
    if value is None:
        return default, f"{key}={_shown(raw)} is not a number"
    if value < low:
        return default, f"{key}={_shown(raw)} is below {low}"
    return value, ""


def _seconds(annotations: Mapping[str, str], key: str, default: float) -> tuple[float, str]:
    raw = annotations.get(key)
    if raw is None:
        return default, ""
    try:
        value = parse_duration(raw.strip() if _readable(raw) else "").total_seconds()
    except (ValueError, OverflowError):  # OverflowError: beyond timedelta ("10**20h")
        return default, f"{key}={_shown(raw)} is not a duration"
    if value < 0:
        return default, f"{key}={_shown(raw)} is negative"
    return value, ""


def _readable(raw: object) -> TypeGuard[str]:
    return isinstance(raw, str) and len(raw) <= MAX_VALUE_CHARS


def _shown(raw: object) -> str:
    """An annotation's value in a message: quoted, at most 64 characters of it."""
    text = raw if isinstance(raw, str) else str(raw)
    return repr(text[:64]) + ("..." if len(text) > 64 else "")


def parse_policy(annotations: Mapping[str, str] | None) -> Policy:
    """The Secret's rollout policy. Pacing is on when ``rollout-max-parallel`` is present; a
    value that cannot be read falls back to its default (1 for K: the safe side)."""
    annotations = annotations or {}
    serial = annotations.get(ANNOTATION_SERIAL) == "true"
    if ANNOTATION_MAX_PARALLEL not in annotations:
        return Policy(serial=serial)
    problems: list[str] = []
    k, p1 = _count(annotations, ANNOTATION_MAX_PARALLEL, 1, 1)
    c, p2 = _count(annotations, ANNOTATION_CANARIES, DEFAULT_CANARIES, 0)
    f, p3 = _count(annotations, ANNOTATION_MAX_FAILURES, DEFAULT_MAX_FAILURES, 1)
    soak, p4 = _seconds(annotations, ANNOTATION_SOAK, DEFAULT_SOAK)
    if soak > MAX_SOAK:
        soak, p4 = MAX_SOAK, f"{ANNOTATION_SOAK} is above {MAX_SOAK:g}s (capped)"
    ttl, p5 = _seconds(annotations, ANNOTATION_SLOT_TTL, DEFAULT_SLOT_TTL)
    if ttl <= 0:
        ttl, p5 = DEFAULT_SLOT_TTL, f"{ANNOTATION_SLOT_TTL} must be positive"
    elif ttl > MAX_SLOT_TTL:
        ttl, p5 = MAX_SLOT_TTL, f"{ANNOTATION_SLOT_TTL} is above {MAX_SLOT_TTL:g}s (capped)"
    problems = [p for p in (p1, p2, p3, p4, p5) if p]
    return Policy(serial, Pacing(k, c, soak, f, ttl), tuple(problems))


def disruptive_units(commands: Any) -> tuple[str, ...]:
    """The disruptive units among a change set's unit commands (``ChangeSet.unit_commands``)."""
    return tuple(sorted({c.unit for c in commands if c.unit in DISRUPTIVE_UNITS}))


# -- what this reader saw, and when -----------------------------------------------------------


class Sightings:
    """When this reader first saw each record another node wrote (a slot's renewal, a serial
    Lease's ``renewTime``, a canary's result), by the reader's own clock: the way client-go's
    leader election judges a Lease by when *it* observed the last change, not by the writer's
    timestamp. Only records still present are remembered, so it stays as small as the Lease."""

    def __init__(self) -> None:
        self._first: dict[Hashable, float] = {}
        self._line: tuple[Hashable, float] | None = None

    def first(self, key: Hashable, now: float) -> float:
        return self._first.setdefault(key, now)

    def keep(self, keys: Iterable[Hashable]) -> None:
        wanted = set(keys)
        self._first = {k: v for k, v in self._first.items() if k in wanted}

    def since(self, key: Hashable, now: float) -> float:
        """When this reader first saw the line in the state ``key`` (one state remembered: a
        new state starts a new clock)."""
        if self._line is None or self._line[0] != key:
            self._line = (key, now)
            return now
        return self._line[1]

    def believed(self, key: Hashable, written: float | None, now: float) -> float:
        """The time to judge a record by: the writer's, unless it is unknown, not finite, or
        more than :data:`CLOCK_SKEW` ahead of when this reader first saw the record; then that
        first sighting."""
        seen = self.first(key, now)
        if written is None or not math.isfinite(written) or written > seen + CLOCK_SKEW:
            return seen
        return written


def bounded_seconds(value: object, default: float, high: float) -> float:
    """A duration read from a Lease or ledger: a finite number in (0, ``high``], else
    ``default`` (not a number, NaN, infinite, zero or negative); above ``high``: ``high``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        return default
    return min(number, high)


# -- serial mode (Gardener's leader election on the Lease spec) --------------------------------


@dataclass(frozen=True)
class SerialStep:
    """``acquire``: write the Lease with us as holder; ``wait``: another node holds it."""

    action: Literal["acquire", "wait"]
    holder: str | None = None
    #: seconds until the other holder's Lease expires (``wait``)
    expires_in: float = 0.0
    #: the Lease ``spec`` to write (``acquire``)
    spec: Mapping[str, Any] = field(default_factory=dict)


def serial_step(
    spec: Mapping[str, Any],
    me: str,
    now: float,
    duration: int,
    seen: Sightings | None = None,
) -> SerialStep:
    """Gardener's ``acquiredByAnotherInstance`` / ``renewedInTime`` / ``tryAcquireOrRenew``,
    with the other holder's numbers bounded: its ``leaseDurationSeconds`` by our ``duration``
    (the pool's), its ``renewTime`` by when this reader first saw it (``seen``: the reader's
    memory; without it the Lease counts as renewed ``now``)."""
    holder = spec.get("holderIdentity") or None
    if seen is None:
        seen = Sightings()
    if holder is not None and holder != me:
        raw = spec.get("renewTime")
        seconds = spec.get("leaseDurationSeconds")
        key = ("serial", str(holder), str(raw), str(seconds))
        seen.keep([key])
        if raw and isinstance(seconds, int) and not isinstance(seconds, bool) and seconds >= 0:
            renew = seen.believed(key, parse_micro_time(raw), now)
            left = renew + min(seconds, max(duration, 0)) - now
            if left > 0:
                return SerialStep("wait", holder=holder, expires_in=left)
    else:
        seen.keep([])
    new = dict(spec)
    if holder != me:
        new["holderIdentity"] = me
        new["leaseDurationSeconds"] = duration
        new["acquireTime"] = micro_time(now)
    new["renewTime"] = micro_time(now)
    return SerialStep("acquire", holder=me, spec=new)


def serial_released(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Gardener's release: holder, duration, acquire and renew time all cleared."""
    drop = {"holderIdentity", "leaseDurationSeconds", "acquireTime", "renewTime"}
    return {k: v for k, v in spec.items() if k not in drop}


def micro_time(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utc(at: float) -> str:
    """A moment for messages: fixed (not a countdown), so a message changes only with facts."""
    try:
        return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        return f"{at!r}s since the epoch"  # far out of range: no date to show


def parse_micro_time(value: object) -> float | None:
    if not isinstance(value, str) or not value:
        return None
    text = value.replace("Z", "+00:00")
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    try:
        return moment.timestamp()
    except (OverflowError, ValueError):
        return None


# -- the paced rollout ------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One of the K places: its holder applies a disruptive change of ``checksum``."""

    host: str
    checksum: str
    renewed: float
    ttl: float
    canary: bool = False
    #: handed to ``host`` by the node that left it, not claimed yet (see :func:`hand_over`)
    handed: bool = False

    def expired(self, now: float) -> bool:
        return self.renewed + self.ttl <= now


@dataclass(frozen=True)
class Ledger:
    """The pool's record for the current checksum (an older checksum's record is dropped when
    a node first sees a new one: a new Secret resets canaries and the breaker)."""

    checksum: str = ""
    slots: tuple[Slot, ...] = ()
    #: hosts that took a canary place for ``checksum``, in order
    canaries: tuple[str, ...] = ()
    #: canary -> when it applied ``checksum`` and passed the health gate (the others' successes
    #: are not kept: nothing waits for them, and the ledger stays O(K + C + F) in size)
    healthy: Mapping[str, float] = field(default_factory=dict)
    #: host -> why it failed ``checksum`` (apply error, rollback, slot lost)
    failed: Mapping[str, str] = field(default_factory=dict)
    #: the line of waiting nodes, as numbered tickets (a bakery): the next number to hand out,
    #: the lowest number that may still be waiting, and the numbers at or above ``turn`` that
    #: were already served (at most K: served ones below ``turn`` are forgotten)
    tickets: int = 0
    turn: int = 0
    served: tuple[int, ...] = ()
    #: the host that drew each waiting ticket (a leaving node hands its place to the head's)
    hosts: Mapping[int, str] = field(default_factory=dict)
    #: the pool's join window, learned from its joins (0: none learned yet); kept across
    #: checksums, since the pool's size is what it follows (see :func:`learn_window`)
    window: float = 0.0
    #: how many nodes joined the rollout of ``checksum`` so far (drew a ticket, or took a place
    #: without one): each node of the pool that is paced joins once
    joined: int = 0
    #: the pool's size as its last paced rollout counted it (the ``joined`` of the checksum
    #: before; 0: not known yet): the nodes still outside the line are about ``pool - joined``,
    #: which sizes the join window exactly (:func:`join_window`) instead of learning it
    pool: int = 0

    def waiting(self) -> int:
        """Tickets handed out and not served (or passed over) yet."""
        return self.tickets - self.turn - len(self.served)

    def position(self, ticket: int | None) -> int | None:
        """How many waiting tickets are ahead of ``ticket``; None when it is not a waiting
        ticket of this ledger (served, passed over, from another checksum, or no ticket); a
        node without one would stand behind all of them."""
        if ticket is None or not self.turn <= ticket < self.tickets or ticket in self.served:
            return None
        return ticket - self.turn - sum(1 for t in self.served if t < ticket)

    def head(self) -> int | None:
        """The first waiting ticket, if any."""
        return next((t for t in range(self.turn, self.tickets) if t not in self.served), None)

    def holders(self) -> tuple[str, ...]:
        return tuple(s.host for s in self.slots)

    def slot_of(self, host: str) -> Slot | None:
        return next((s for s in self.slots if s.host == host), None)

    def breaker_open(self, pacing: Pacing) -> bool:
        return len(self.failed) >= pacing.max_failures

    # -- wire form ----------------------------------------------------------------------------

    def dump(self) -> str:
        return json.dumps(
            {
                "checksum": self.checksum,
                "slots": [
                    {
                        "host": s.host,
                        "checksum": s.checksum,
                        "renewed": round(s.renewed, 3),
                        "ttl": s.ttl,
                        "canary": s.canary,
                        **({"handed": True} if s.handed else {}),
                    }
                    for s in self.slots
                ],
                "canaries": list(self.canaries),
                "healthy": {k: round(v, 3) for k, v in sorted(self.healthy.items())},
                "failed": dict(sorted(self.failed.items())),
                **(
                    {
                        "line": {
                            "tickets": self.tickets,
                            "turn": self.turn,
                            "served": self.served,
                            **(
                                {"hosts": {str(t): h for t, h in sorted(self.hosts.items())}}
                                if self.hosts
                                else {}
                            ),
                        }
                    }
                    if self.tickets
                    else {}
                ),
                **({"window": round(self.window, 3)} if round(self.window, 3) else {}),
                **({"joined": self.joined} if self.joined else {}),
                **({"pool": self.pool} if self.pool else {}),
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def load(cls, text: str | None) -> Ledger:
        """The ledger an annotation carries (see :meth:`parse`)."""
        return cls.parse(text)[0]

    @classmethod
    def parse(cls, text: str | None) -> tuple[Ledger, tuple[str, ...]]:
        """The ledger an annotation carries, and what was wrong with it. Never raises: text
        that is not a ledger reads as empty (the breaker cannot be kept open by garbage); an
        entry that cannot be read is dropped, a number that is not finite is kept as NaN for
        :func:`current` to judge by this reader's own sightings (K still holds for every slot
        with a host)."""
        if not text:
            return cls(), ()
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return cls(), (f"not JSON ({str(exc)[:80]})",)
        if not isinstance(doc, dict):
            return cls(), (f"not a JSON object but {type(doc).__name__}",)
        problems: list[str] = []

        def entries(key: str, kind: type[list[Any]] | type[dict[str, Any]]) -> Any:
            value = doc.get(key)
            if value is None:
                return kind()
            if not isinstance(value, kind):
                problems.append(f"{key} is not a {kind.__name__}")
                return kind()
            if len(value) > MAX_LEDGER_ENTRIES:
                problems.append(f"{key} has {len(value)} entries (more than {MAX_LEDGER_ENTRIES})")
                return kind()
            return value

        slots: list[Slot] = []
        for index, raw in enumerate(entries("slots", list)):
            if not isinstance(raw, dict) or not _name(raw.get("host")):
                problems.append(f"slot {index} has no host")
                continue
            host = str(raw["host"])
            if any(s.host == host for s in slots):
                problems.append(f"slot {index} repeats host {host!r}")
                continue
            renewed, ttl = _number(raw.get("renewed")), _number(raw.get("ttl"))
            if not math.isfinite(renewed) or not math.isfinite(ttl) or ttl <= 0:
                problems.append(f"slot of {host} has renewed={renewed!r} ttl={ttl!r}")
            checksum = raw.get("checksum")
            slots.append(
                Slot(
                    host,
                    checksum if isinstance(checksum, str) else "",
                    renewed,
                    ttl,
                    raw.get("canary") is True,
                    raw.get("handed") is True,
                )
            )
        checksum = doc.get("checksum")
        if checksum is not None and not isinstance(checksum, str):
            problems.append("checksum is not a string")
            checksum = ""
        canaries = tuple(dict.fromkeys(h for h in entries("canaries", list) if _name(h)))
        healthy: dict[str, float] = {}
        for host, at in entries("healthy", dict).items():
            healthy[host[:MAX_NAME]] = _number(at)
            if not math.isfinite(healthy[host[:MAX_NAME]]):
                problems.append(f"healthy time of {host[:MAX_NAME]} is {at!r}")
        failed = {
            str(h)[:MAX_NAME]: str(why)[:MAX_WHY] for h, why in entries("failed", dict).items()
        }
        tickets, turn, served, hosts = _line(doc.get("line"), problems)
        window = _number(doc.get("window", 0.0))
        if not 0.0 <= window <= MAX_JOIN_WINDOW:  # NaN too
            problems.append(f"window {str(doc.get('window'))[:40]} is out of range (forgotten)")
            window = 0.0
        joined, pool = (_node_count(doc, key, problems) for key in ("joined", "pool"))
        ledger = cls(
            checksum=checksum or "",
            slots=tuple(slots),
            canaries=canaries,
            healthy=healthy,
            failed=failed,
            tickets=tickets,
            turn=turn,
            served=served,
            hosts=hosts,
            window=window,
            joined=joined,
            pool=pool,
        )
        return ledger, tuple(problems)


def _node_count(doc: Mapping[str, Any], key: str, problems: list[str]) -> int:
    """A count of nodes a ledger carries: a whole number in [0, MAX_POOL], else forgotten (0,
    as if never counted) with the problem named."""
    raw = doc.get(key)
    if raw is None:
        return 0
    if _whole(raw) and raw <= MAX_POOL:
        return int(raw)
    problems.append(f"{key} {str(raw)[:40]} is not a count of nodes (forgotten)")
    return 0


def _line(raw: object, problems: list[str]) -> tuple[int, int, tuple[int, ...], dict[int, str]]:
    """The line's numbers, or a fresh line (every waiter then draws a new ticket) when they are
    not whole numbers with 0 <= turn <= tickets <= MAX_TICKET and served within [turn, tickets).
    The tickets' hosts are kept for waiting tickets only (others are dropped: a place is then
    not handed to them, they take it themselves)."""
    if raw is None:
        return 0, 0, (), {}
    if isinstance(raw, dict):
        tickets, head, served = raw.get("tickets"), raw.get("turn"), raw.get("served", [])
        if (
            _whole(tickets)
            and _whole(head)
            and isinstance(served, list)
            and len(served) <= MAX_LEDGER_ENTRIES
            and all(_whole(t) and head <= t < tickets for t in served)
            and head <= tickets
        ):
            done = set(served)
            return tickets, head, tuple(sorted(done)), _hosts(raw.get("hosts"), head, tickets, done)
    problems.append(f"line {str(raw)[:80]} is not a line of tickets (started afresh)")
    return 0, 0, (), {}


def _hosts(raw: object, head: int, tickets: int, served: set[int]) -> dict[int, str]:
    if not isinstance(raw, dict) or len(raw) > MAX_LEDGER_ENTRIES:
        return {}
    hosts: dict[int, str] = {}
    for key, host in raw.items():
        whole = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 16
        ticket = int(key) if whole else -1
        if head <= ticket < tickets and ticket not in served and _name(host):
            hosts[ticket] = host
    return hosts


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TICKET


def _name(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME


def _number(value: object) -> float:
    """A number of the ledger as a float; NaN when it is none (or too big for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.nan


LOST = "its slot expired before it reported a result (agent or node lost)"


def believed(ledger: Ledger, now: float, ttl: float, seen: Sightings | None = None) -> Ledger:
    """The ledger with every number bounded as this reader believes it: a slot's ttl finite,
    positive and at most :data:`MAX_SLOT_TTL` (else the pool's ``ttl``), its renewal and every
    healthy time no later than :data:`CLOCK_SKEW` after this reader first saw them (``seen``:
    the reader's memory; without it, ``now``). Written back, it repairs the Lease for all."""
    if seen is None:
        seen = Sightings()
    keys: list[Hashable] = []
    slots = []
    for slot in ledger.slots:
        key: Hashable = ("slot", slot.host, slot.checksum, repr(slot.renewed), repr(slot.ttl))
        keys.append(key)
        slots.append(
            replace(
                slot,
                renewed=seen.believed(key, slot.renewed, now),
                ttl=bounded_seconds(slot.ttl, ttl, MAX_SLOT_TTL),
            )
        )
    healthy = {}
    for host, at in ledger.healthy.items():
        key = ("healthy", ledger.checksum, host, repr(at))
        keys.append(key)
        healthy[host] = seen.believed(key, at, now)
    seen.keep(keys)
    return replace(ledger, slots=tuple(slots), healthy=healthy)


def current(
    ledger: Ledger,
    checksum: str,
    now: float,
    ttl: float = DEFAULT_SLOT_TTL,
    seen: Sightings | None = None,
) -> Ledger:
    """The ledger for ``checksum`` at ``now``, its numbers :func:`believed`: a new checksum
    starts a fresh record (holders of the old one keep their slots until they finish or expire:
    they still count against K); an expired slot is freed, and if it was for ``checksum`` and
    its holder never reported, that holder counts as failed (it may have died of the change);
    so does a canary of ``checksum`` that holds no slot and has no result (its slot is gone)."""
    ledger = for_checksum(believed(ledger, now, ttl, seen), checksum)
    failed = dict(ledger.failed)
    slots = []
    for slot in ledger.slots:
        if not slot.expired(now):
            slots.append(slot)
        elif slot.checksum == checksum and slot.host not in ledger.healthy and not slot.handed:
            failed.setdefault(slot.host, LOST)
    holders = {s.host for s in slots}
    for canary in ledger.canaries:
        if canary not in holders and canary not in ledger.healthy:
            failed.setdefault(canary, LOST)
    return replace(ledger, slots=tuple(slots), failed=failed)


def for_checksum(ledger: Ledger, checksum: str) -> Ledger:
    """The ledger as the record of ``checksum``: another checksum's record starts afresh
    (its holders keep their slots), as in :func:`current`."""
    if ledger.checksum == checksum:
        return ledger
    # the joins the last rollout counted are the pool's size now (when it counted none, the
    # size known before stays)
    pool = ledger.joined or ledger.pool
    return Ledger(checksum=checksum, slots=ledger.slots, window=ledger.window, pool=pool)


def count_join(ledger: Ledger, *, counted: int = 0) -> Ledger:
    """``ledger`` as a joining node writes it: one more node joined its rollout; and, for a
    pool that knows no size yet, the size this node ``counted`` (0: none)."""
    return replace(
        ledger,
        joined=min(ledger.joined + 1, MAX_POOL),
        pool=ledger.pool or min(max(counted, 0), MAX_POOL),
    )


def join_window(ledger: Ledger) -> float:
    """The window a node outside the line draws its join delay in (0: none known; the caller
    has its floor). With n nodes outside, each drawing in a window W, the first writes after
    about W / n; W = n * :data:`JOIN_TARGET` spaces the joins JOIN_TARGET apart whatever the
    pool's size. A pool that counted its last rollout knows n: ``pool - joined`` (at least
    one). A pool that has not (its first paced rollout) uses the window its joins learned
    (:func:`learn_window`)."""
    if ledger.pool:
        return min(JOIN_TARGET * max(ledger.pool - ledger.joined, 1), MAX_JOIN_WINDOW)
    return ledger.window


def learn_window(
    ledger: Ledger, window: float, waited: float, floor: float, *, lost: bool = False
) -> Ledger:
    """The ledger a joining node writes, with what its join says of the pool's join window.

    Nodes outside the line join after a random delay in the window; the first writes, and any
    other whose delay ends before that write is seen collides with it. With n outside, the
    first delay is about window / n, so a fixed window makes collisions per join grow with n
    (with the pool). The node whose join landed drew ``waited`` in ``window``: n is about
    window / waited, and the window that makes the first of them write after
    :data:`JOIN_TARGET` is about n times that. One join's delay is noisy, so the window moves
    by the square root of that ratio, within :data:`JOIN_LEARN_STEP`. The collisions per join
    then stay near JOIN_TARGET's share of the time a write takes to be seen, whatever the
    pool's size. That share grows with the time a write takes to be seen, which grows with the
    API server's load: a node that ``lost`` a race before its join landed (its own wait then
    says nothing of the pool's: it drew from its backed-off window) makes the pool's window at
    least twice ``window``, the pool's when it first drew, so that a slow server widens it until
    joins rarely collide. Bounded by
    :data:`MAX_JOIN_WINDOW`; one at ``floor`` or below is none (0).
    """
    widest, narrowest = JOIN_LEARN_STEP
    if lost:
        # twice the pool's window the loser drew from, at least; not more: the losers of one
        # burst all drew from the same window, so they do not double the pool's again and again
        # (before, each doubled the pool's current one, and a loser's own backed-off window
        # counted too: a start where many lost grew it to minutes, and the line ran dry)
        learned = max(ledger.window, window * 2.0)
    else:
        ratio = JOIN_TARGET / max(waited, 0.01)
        learned = window * min(widest, max(narrowest, math.sqrt(ratio)))
    learned = min(learned, MAX_JOIN_WINDOW)
    # at the floor it is what every node has without a ledger: kept as none learned (0)
    return replace(ledger, window=learned if learned > floor else 0.0)


@dataclass(frozen=True)
class Decision:
    """``proceed``: the ledger with our slot in it (write it, then apply); ``wait``: why."""

    action: Literal["proceed", "wait"]
    ledger: Ledger
    reason: Reason | None = None
    message: str = ""
    canary: bool = False
    #: when waiting: seconds until the situation may change by time alone (a slot's expiry, the
    #: end of the soak, the grace of a turn not taken); None when only other nodes can change it
    retry_in: float | None = None
    #: the ticket this node holds in the line after this decision (a wait hands one out when
    #: the node has none that is still waiting)
    ticket: int | None = None


@dataclass(frozen=True)
class Turn:
    """Whose turn it is in the line (:func:`turn`)."""

    #: the node may take a place now
    now: bool
    #: its ticket (None: it takes a place without one, or must draw one)
    ticket: int | None
    #: the ledger with a ticket drawn for it (when it has to wait and held none)
    ledger: Ledger
    #: when waiting with places free: seconds until the grace lets it pass those ahead
    retry_in: float | None = None


def turn(
    ledger: Ledger,
    ticket: int | None,
    places: int,
    now: float,
    seen: Sightings | None = None,
    key: Hashable = (),
    depth: int | None = None,
) -> Turn:
    """Is it this node's turn to take one of ``places`` free places? The first ``places``
    waiting tickets may take them; a newcomer without a ticket only when fewer are waiting.
    Only those wake up when a place frees: the rest of the pool keeps watching without a
    request. When the free places stay untaken for :data:`TICKET_GRACE` (by this reader's own
    sightings of the line in the state ``key``: the place, the holders, the line's head), the
    next tickets may pass the idle ones, one more after one period, 3 after two, 2^k - 1 after
    k: a dead waiter costs the pool one grace, a forged line of 2^53 tickets 53 of them.

    ``depth``: a node without a ticket draws one only while fewer than ``depth`` tickets wait;
    behind a longer line it stays out of it (``ticket`` None, the ledger unchanged: no write)
    and looks again when the line shortens, or after a grace in which free places stood
    untaken (a line of dead or forged tickets does not keep it out for ever)."""
    position = ledger.position(ticket)
    if position is None:
        ticket, position = None, ledger.waiting()
    outside = ticket is None and depth is not None and position >= depth
    if places <= 0:
        if outside:
            return Turn(False, None, ledger)
        return _draw(ledger, ticket, retry_in=None)
    since = now if seen is None else seen.since((key, ledger.turn, ledger.served, places), now)
    periods = int(max(0.0, now - since) // TICKET_GRACE) if position >= places else 0
    if outside and periods == 0:
        return Turn(False, None, ledger, retry_in=max(0.0, since + TICKET_GRACE - now))
    if position < places + (2 ** min(periods, 60) - 1):
        return Turn(True, ticket, ledger)
    needed = math.ceil(math.log2(position - places + 2))
    return _draw(ledger, ticket, retry_in=max(0.0, since + needed * TICKET_GRACE - now))


def _draw(ledger: Ledger, ticket: int | None, retry_in: float | None) -> Turn:
    if ticket is not None:
        return Turn(False, ticket, ledger, retry_in)
    if ledger.tickets >= MAX_TICKET:  # a forged counter: a fresh line
        ledger = replace(ledger, tickets=0, turn=0, served=(), hosts={})
    drawn = replace(ledger, tickets=ledger.tickets + 1)
    return Turn(False, ledger.tickets, drawn, retry_in)


def serve(ledger: Ledger, ticket: int | None, places: int) -> Ledger:
    """The line once ``ticket`` took a place: served (the line moves on past the served head);
    a ticket that took its place by passing others moves the line to behind itself (those it
    passed draw a new ticket when they wake)."""
    position = ledger.position(ticket)
    if ticket is None or position is None:
        return ledger
    if position >= places:
        ledger = replace(
            ledger, turn=ticket + 1, served=tuple(t for t in ledger.served if t > ticket)
        )
    else:
        served = sorted({*ledger.served, ticket})
        head = ledger.turn
        while served and served[0] == head:
            served.pop(0)
            head += 1
        ledger = replace(ledger, turn=head, served=tuple(served))
    waiting = {t: h for t, h in ledger.hosts.items() if ledger.position(t) is not None}
    return replace(ledger, hosts=waiting)


def decide(
    pacing: Pacing,
    ledger: Ledger,
    host: str,
    checksum: str,
    now: float,
    seen: Sightings | None = None,
    *,
    ticket: int | None = None,
    line: bool = True,
) -> Decision:
    """May ``host`` start applying ``checksum`` (a disruptive change) now? ``seen``: this
    reader's memory of when it first saw each record (see :class:`Sightings`); ``ticket``: its
    ticket in the line, if it drew one (``line=False``: no line, as under the serial Lease,
    which orders the nodes itself). A wait that time alone can end says when (``retry_in``,
    never more than the longest ttl, soak or passing of a forged line)."""
    ledger = current(ledger, checksum, now, pacing.slot_ttl, seen)
    mine = ledger.slot_of(host)
    if mine is not None and mine.checksum == checksum and mine.handed:
        # handed to us by the node that left it: ours without a write (claimed while applying)
        return Decision("proceed", ledger, canary=mine.canary)
    if mine is not None and mine.checksum == checksum:
        renewed = replace(mine, renewed=now, ttl=pacing.slot_ttl)
        slots = tuple(renewed if s.host == host else s for s in ledger.slots)
        return Decision("proceed", replace(ledger, slots=slots), canary=mine.canary)
    if mine is not None:  # a slot for an older checksum, abandoned: ours again, for this one
        ledger = replace(ledger, slots=tuple(s for s in ledger.slots if s.host != host))
    short = checksum[:12]
    if ledger.breaker_open(pacing):
        failed = "; ".join(f"{h}: {why}" for h, why in sorted(ledger.failed.items()))
        message = (
            f"circuit breaker open for OSC {short}: {len(ledger.failed)} node(s) failed "
            f"(limit {pacing.max_failures}): {failed}; the pool is held until the OSC Secret "
            "changes"
        )
        return Decision("wait", ledger, REASON_BREAKER, message)
    places = pacing.max_parallel - len(ledger.slots)
    active = [c for c in ledger.canaries if c not in ledger.failed]
    canary = len(active) < pacing.canaries
    held: tuple[Reason, str, float | None] | None = None
    if places <= 0:
        first_expiry = min(s.renewed + s.ttl for s in ledger.slots) - now
        message = f"all {pacing.max_parallel} rollout slot(s) of OSC {short} are taken"
        held = (REASON_SLOT, message, max(0.0, first_expiry))
    elif canary:
        places = min(places, pacing.canaries - len(active))
    elif pending := [c for c in active if c not in ledger.healthy]:
        message = f"waiting for the canaries of OSC {short} to apply it: {', '.join(pending)}"
        held = (REASON_CANARIES, message, None)
    elif active and now < (soaked := max(ledger.healthy[c] for c in active) + pacing.soak):
        message = (
            f"canaries {', '.join(active)} applied OSC {short}; soaking for "
            f"{pacing.soak:g}s (until {utc(soaked)})"
        )
        held = (REASON_CANARIES, message, soaked - now)
    if not line:
        if held is not None:
            return Decision("wait", ledger, held[0], held[1], retry_in=held[2])
        ticket = None
    else:
        key = (checksum, tuple(sorted(ledger.holders())))
        depth = JOIN_DEPTH * pacing.max_parallel
        step = turn(ledger, ticket, 0 if held is not None else places, now, seen, key, depth)
        if step.ticket is not None and step.ticket != ticket:  # drawn: the line knows by whom
            ledger = replace(step.ledger, hosts={**step.ledger.hosts, step.ticket: host})
        else:
            ledger = step.ledger
        ticket = step.ticket
        if held is not None:
            return Decision("wait", ledger, held[0], held[1], retry_in=held[2], ticket=ticket)
        if not step.now:
            message = (
                f"waiting in line for one of {pacing.max_parallel} rollout slot(s) of OSC {short}"
            )
            return Decision(
                "wait", ledger, REASON_SLOT, message, retry_in=step.retry_in, ticket=ticket
            )
        ledger = serve(ledger, ticket, places)
    slot = Slot(host, checksum, now, pacing.slot_ttl, canary=canary)
    canaries = (*ledger.canaries, host) if canary else ledger.canaries
    return Decision(
        "proceed", replace(ledger, slots=(*ledger.slots, slot), canaries=canaries), canary=canary
    )


def renew(
    ledger: Ledger, host: str, checksum: str, now: float, ttl: float | None = None
) -> Ledger | None:
    """Our slot renewed (a handed one claimed, with the pool's ``ttl``); None when we do not
    hold it any more (it expired and was taken)."""
    mine = ledger.slot_of(host)
    if mine is None or mine.checksum != checksum:
        return None
    renewed = replace(mine, renewed=now, handed=False, ttl=mine.ttl if ttl is None else ttl)
    return replace(ledger, slots=tuple(renewed if s.host == host else s for s in ledger.slots))


def hand_over(
    pacing: Pacing, ledger: Ledger, checksum: str, now: float, seen: Sightings | None = None
) -> Ledger:
    """The ledger a node leaving its place writes: the place handed, in the same write, to the
    host of the first waiting ticket, if that host may take it now (exactly as it would decide
    itself: K, canaries, the breaker). The receiver then applies without a write of its own, so
    a freed place is not raced for at all. Its place lives :data:`HANDOFF_TTL` until it claims
    it: a receiver that died in line costs at most that, and is not counted as failed. Canary
    places are not handed (the receiver takes its own, the canary list is its record)."""
    head = ledger.head()
    host = ledger.hosts.get(head) if head is not None else None
    if ledger.checksum != checksum or host is None or ledger.slot_of(host) is not None:
        return ledger
    decision = decide(pacing, ledger, host, checksum, now, seen, ticket=head)
    given = decision.ledger.slot_of(host)
    if decision.action != "proceed" or decision.canary or given is None:
        return ledger
    handed = replace(given, ttl=min(HANDOFF_TTL, pacing.slot_ttl), handed=True)
    slots = tuple(handed if s.host == host else s for s in decision.ledger.slots)
    return replace(decision.ledger, slots=slots)


def leave(ledger: Ledger, host: str) -> Ledger:
    """Our slot freed without a result: its update was superseded by a newer OSC before the
    health gate's verdict (a result of an older checksum means nothing to the pool now, and an
    update whose verdict never came must not count as healthy)."""
    return replace(ledger, slots=tuple(s for s in ledger.slots if s.host != host))


def finish(
    ledger: Ledger, host: str, checksum: str, now: float, *, ok: bool, why: str = ""
) -> Ledger:
    """Our slot freed and the result recorded (only for the ledger's own checksum: a result of
    an older one means nothing to the pool now). Only a canary's success is kept (the rest of
    the pool waits for it and its soak); any other node's success changes no decision, so the
    ledger does not grow with the pool."""
    slots = tuple(s for s in ledger.slots if s.host != host)
    ledger = replace(ledger, slots=slots)
    if ledger.checksum != checksum:
        return ledger
    if ok:
        if host not in ledger.canaries:
            return ledger
        return replace(ledger, healthy={**ledger.healthy, host: now})
    return replace(ledger, failed={**ledger.failed, host: why or "failed"})
