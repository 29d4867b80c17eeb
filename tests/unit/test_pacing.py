"""The rollout decisions (pure): the policy from annotations, Gardener's serial Lease steps,
slots, canaries with soak, the circuit breaker, and a model of a pool stepping at random."""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.controllers.osc import pacing
from node_agent.controllers.osc.pacing import (
    Ledger,
    Pacing,
    Slot,
    decide,
    finish,
    parse_policy,
    renew,
)

CS = "a" * 64
CS2 = "b" * 64


def test_policy_off_unless_asked() -> None:
    assert parse_policy(None) == pacing.Policy()
    assert not parse_policy({"other": "x"}).active
    serial = parse_policy({"reconciliation.osc.node-agent.gardener.cloud/serial": "true"})
    assert serial.serial
    assert serial.pacing is None
    assert serial.active
    assert not parse_policy({"reconciliation.osc.node-agent.gardener.cloud/serial": "1"}).serial


def test_policy_reads_every_annotation() -> None:
    policy = parse_policy(
        {
            "node-agent.gardener.cloud/rollout-max-parallel": "3",
            "node-agent.gardener.cloud/rollout-canaries": "2",
            "node-agent.gardener.cloud/rollout-canary-soak": "90s",
            "node-agent.gardener.cloud/rollout-max-failures": "4",
            "node-agent.gardener.cloud/rollout-slot-ttl": "2m",
        }
    )
    assert policy.pacing == Pacing(3, 2, 90.0, 4, 120.0)
    assert policy.problems == ()


def test_policy_defaults_and_bad_values_fall_back_to_the_safe_side() -> None:
    policy = parse_policy(
        {
            "node-agent.gardener.cloud/rollout-max-parallel": "many",
            "node-agent.gardener.cloud/rollout-max-failures": "0",
            "node-agent.gardener.cloud/rollout-canary-soak": "soon",
        }
    )
    assert policy.pacing == Pacing(1, 0, pacing.DEFAULT_SOAK, 1, pacing.DEFAULT_SLOT_TTL)
    assert len(policy.problems) == 3
    assert "rollout-max-parallel='many'" in policy.problems[0]


@pytest.mark.parametrize("value", ["\u0663", "1_0", "\uff13", "3.0", "0x3"])
def test_a_count_is_ascii_digits(value: str) -> None:
    """int() reads other scripts' digits and underscores; the pool's annotations are plain."""
    policy = parse_policy({"node-agent.gardener.cloud/rollout-max-parallel": value})
    assert policy.pacing is not None
    assert policy.pacing.max_parallel == 1
    assert "is not a number" in policy.problems[0]


@pytest.mark.parametrize(
    "value",
    ["99999999999999999999h", "9" * 400 + "s", "7" * (256 << 10), 3600, ["1h"]],
    ids=["beyond timedelta", "beyond float", "256 KiB of digits", "an int", "a list"],
)
def test_any_annotation_value_falls_back_to_its_default_with_a_short_problem(
    value: object,
) -> None:
    """Whatever the Secret's annotations hold, the policy is read at once (a value beyond any
    duration raised OverflowError out of the rollout's admission, a long run of digits took
    minutes), and the problem quotes only the start of the value."""
    annotations: Any = {
        "node-agent.gardener.cloud/rollout-max-parallel": value,
        "node-agent.gardener.cloud/rollout-canary-soak": value,
        "node-agent.gardener.cloud/rollout-slot-ttl": value,
    }
    started = time.monotonic()
    policy = parse_policy(annotations)
    assert time.monotonic() - started < 1.0
    assert policy.pacing == Pacing(1, 0, pacing.DEFAULT_SOAK, 1, pacing.DEFAULT_SLOT_TTL)
    assert len(policy.problems) == 3
    assert all(len(problem) < 200 for problem in policy.problems)


def test_disruptive_units() -> None:
    @dataclass
    class Cmd:
        unit: str

    commands = [Cmd("foo.service"), Cmd("kubelet.service"), Cmd("containerd.service")]
    assert pacing.disruptive_units(commands) == ("containerd.service", "kubelet.service")
    assert pacing.disruptive_units([Cmd("foo.service")]) == ()


# -- serial mode: Gardener's leader election ------------------------------------------------


def test_serial_acquire_free_lease_as_gardener_does() -> None:
    step = pacing.serial_step({}, "node-a", 1000.0, 600)
    assert step.action == "acquire"
    assert step.spec["holderIdentity"] == "node-a"
    assert step.spec["leaseDurationSeconds"] == 600
    assert step.spec["acquireTime"] == step.spec["renewTime"] == "1970-01-01T00:16:40.000000Z"


def test_serial_waits_for_a_live_holder_and_takes_an_expired_one() -> None:
    spec = pacing.serial_step({}, "node-a", 1000.0, 600).spec
    wait = pacing.serial_step(spec, "node-b", 1100.0, 600)
    assert (wait.action, wait.holder) == ("wait", "node-a")
    assert abs(wait.expires_in - 500.0) < 1e-3
    taken = pacing.serial_step(spec, "node-b", 1600.5, 600)
    assert taken.action == "acquire"
    assert taken.spec["holderIdentity"] == "node-b"


def test_serial_renew_keeps_acquire_time_and_release_clears_it() -> None:
    spec = pacing.serial_step({}, "node-a", 1000.0, 600).spec
    again = pacing.serial_step(spec, "node-a", 1200.0, 600).spec
    assert again["acquireTime"] == spec["acquireTime"]
    assert again["renewTime"] != spec["renewTime"]
    assert pacing.serial_released({**again, "other": 1}) == {"other": 1}


def test_serial_holder_without_renew_time_is_not_respected() -> None:
    step = pacing.serial_step({"holderIdentity": "ghost"}, "node-a", 1.0, 600)
    assert step.action == "acquire"


# -- slots, canaries, breaker ----------------------------------------------------------------


def test_at_most_k_then_wait_for_slot() -> None:
    policy = Pacing(max_parallel=2, slot_ttl=60)
    ledger = Ledger()
    for host in ("a", "b"):
        d = decide(policy, ledger, host, CS, 0.0)
        assert d.action == "proceed"
        ledger = d.ledger
    d = decide(policy, ledger, "c", CS, 10.0)
    assert (d.action, d.reason) == ("wait", pacing.REASON_SLOT)
    # the holders are not in the words: a waiting node's condition does not change with them
    assert d.message == "all 2 rollout slot(s) of OSC aaaaaaaaaaaa are taken"
    assert d.retry_in == 50.0
    # a holder asking again keeps its slot (renewed)
    assert decide(policy, ledger, "a", CS, 10.0).action == "proceed"


def test_finished_slot_frees_a_place() -> None:
    policy = Pacing(max_parallel=1, slot_ttl=60)
    ledger = decide(policy, Ledger(), "a", CS, 0.0).ledger
    ledger = finish(ledger, "a", CS, 5.0, ok=True)
    assert ledger.healthy == {}  # not a canary: nothing waits for its result
    assert ledger.slots == ()
    assert decide(policy, ledger, "b", CS, 6.0).action == "proceed"


def test_only_canaries_leave_a_result_so_the_ledger_does_not_grow_with_the_pool() -> None:
    """Before, every node's success stayed in ``healthy``: 1,000 nodes made the ledger too big
    to read (reset) and ~5,000 pushed the Lease past 256 KiB."""
    policy = Pacing(max_parallel=3, canaries=1, soak=0.0, slot_ttl=60)
    ledger, now = Ledger(), 0.0
    for i in range(2000):
        name = f"node-{i:04d}"
        d = decide(policy, ledger, name, CS, now)
        assert d.action == "proceed", (name, d.message)
        ledger = finish(d.ledger, name, CS, now, ok=True)
        now += 1.0
    assert ledger.healthy.keys() == {"node-0000"}
    assert Ledger.parse(ledger.dump()) == (ledger, ())
    assert len(ledger.dump()) < 300


def test_expired_slot_frees_the_place_and_counts_as_lost() -> None:
    policy = Pacing(max_parallel=1, max_failures=2, slot_ttl=60)
    ledger = decide(policy, Ledger(), "a", CS, 0.0).ledger
    d = decide(policy, ledger, "b", CS, 61.0)
    assert d.action == "proceed"
    assert d.ledger.failed == {"a": pacing.LOST}
    assert d.ledger.holders() == ("b",)


def test_renew_keeps_a_slot_alive_and_reports_a_lost_one() -> None:
    policy = Pacing(max_parallel=1, slot_ttl=60)
    ledger = decide(policy, Ledger(), "a", CS, 0.0).ledger
    ledger2 = renew(ledger, "a", CS, 50.0)
    assert ledger2 is not None
    assert decide(policy, ledger2, "b", CS, 100.0).action == "wait"
    taken = decide(policy, ledger, "b", CS, 61.0).ledger
    assert renew(taken, "a", CS, 62.0) is None


def test_canaries_first_then_soak() -> None:
    policy = Pacing(max_parallel=3, canaries=1, soak=100.0, slot_ttl=60)
    d = decide(policy, Ledger(), "a", CS, 0.0)
    assert d.action == "proceed"
    assert d.canary
    ledger = d.ledger
    d = decide(policy, ledger, "b", CS, 1.0)
    assert (d.action, d.reason) == ("wait", pacing.REASON_CANARIES)
    assert "to apply it: a" in d.message
    assert d.retry_in is None
    ledger = finish(ledger, "a", CS, 10.0, ok=True)
    d = decide(policy, ledger, "b", CS, 50.0)
    assert (d.action, d.reason) == ("wait", pacing.REASON_CANARIES)
    assert d.retry_in == 60.0
    assert "soaking" in d.message
    d = decide(policy, ledger, "b", CS, 110.0)
    assert d.action == "proceed"
    assert not d.canary


def test_failed_canary_is_replaced_while_the_breaker_allows() -> None:
    policy = Pacing(max_parallel=2, canaries=1, max_failures=2, slot_ttl=60)
    ledger = decide(policy, Ledger(), "a", CS, 0.0).ledger
    ledger = finish(ledger, "a", CS, 5.0, ok=False, why="boom")
    d = decide(policy, ledger, "b", CS, 6.0)
    assert d.action == "proceed"
    assert d.canary
    assert d.ledger.canaries == ("a", "b")


def test_breaker_trips_at_f_and_names_the_failures() -> None:
    policy = Pacing(max_parallel=2, max_failures=1, slot_ttl=60)
    ledger = decide(policy, Ledger(), "a", CS, 0.0).ledger
    ledger = finish(ledger, "a", CS, 5.0, ok=False, why="kubelet.service failed")
    d = decide(policy, ledger, "b", CS, 6.0)
    assert (d.action, d.reason) == ("wait", pacing.REASON_BREAKER)
    assert "a: kubelet.service failed" in d.message
    assert "until the OSC Secret changes" in d.message
    assert d.ledger.breaker_open(policy)


def test_new_checksum_resets_breaker_but_keeps_live_holders_counted() -> None:
    policy = Pacing(max_parallel=2, max_failures=1, slot_ttl=60)
    ledger = decide(policy, Ledger(), "a", CS, 0.0).ledger
    ledger = decide(policy, ledger, "b", CS, 0.0).ledger
    ledger = finish(ledger, "a", CS, 5.0, ok=False, why="x")
    d = decide(policy, ledger, "c", CS2, 6.0)
    # the breaker of CS is gone, but b still applies CS: one slot left for CS2
    assert d.action == "proceed"
    assert d.ledger.checksum == CS2
    assert d.ledger.failed == {}
    assert set(d.ledger.holders()) == {"b", "c"}
    assert decide(policy, d.ledger, "e", CS2, 7.0).reason == pacing.REASON_SLOT
    # b's old result means nothing to CS2, its slot is freed
    after = finish(d.ledger, "b", CS, 8.0, ok=False, why="y")
    assert after.failed == {}
    assert after.holders() == ("c",)


def test_ledger_round_trip_and_garbage() -> None:
    ledger = Ledger(
        CS,
        (Slot("a", CS, 1.5, 60.0, canary=True),),
        ("a",),
        {"x": 2.0},
        {"y": "why"},
    )
    assert Ledger.load(ledger.dump()) == ledger
    assert '"window"' not in ledger.dump()  # none learned: the wire form is as before
    assert Ledger.load("{not json") == Ledger()
    assert Ledger.load('{"slots": [{"host": 1}]}') == Ledger()


# -- the handoff: the node that leaves gives its place to the first ticket ----------------------


def _line_of(policy: Pacing, hosts: list[str], now: float = 0.0) -> Ledger:
    """``hosts`` deciding in order: the first K take places, the rest draw tickets."""
    ledger = Ledger()
    for host in hosts:
        ledger = decide(policy, ledger, host, CS, now).ledger
    return ledger


def test_the_line_knows_who_drew_each_waiting_ticket_and_forgets_the_served() -> None:
    policy = Pacing(max_parallel=1, slot_ttl=60)
    ledger = _line_of(policy, ["a", "b", "c"])
    assert ledger.hosts == {0: "b", 1: "c"}
    assert ledger.head() == 0
    assert Ledger.parse(ledger.dump()) == (ledger, ())
    ledger = finish(ledger, "a", CS, 5.0, ok=True)
    taken = decide(policy, ledger, "b", CS, 6.0, ticket=0).ledger
    assert taken.hosts == {1: "c"}
    assert taken.head() == 1


def test_the_leaving_node_hands_its_place_to_the_first_ticket_in_the_same_write() -> None:
    policy = Pacing(max_parallel=1, slot_ttl=600)
    ledger = finish(_line_of(policy, ["a", "b", "c"]), "a", CS, 5.0, ok=True)
    handed = pacing.hand_over(policy, ledger, CS, 5.0)
    slot = handed.slot_of("b")
    assert slot == Slot("b", CS, 5.0, pacing.HANDOFF_TTL, handed=True)
    assert handed.waiting() == 1
    assert handed.head() == 1
    # the receiver proceeds on it without a write of its own
    mine = decide(policy, handed, "b", CS, 6.0, ticket=0)
    assert mine.action == "proceed"
    assert mine.ledger == handed
    # c, next in line, finds every place taken
    assert decide(policy, handed, "c", CS, 6.0, ticket=1).action == "wait"
    # its first renewal claims it with the pool's ttl
    claimed = renew(handed, "b", CS, 15.0, policy.slot_ttl)
    assert claimed is not None
    assert claimed.slot_of("b") == Slot("b", CS, 15.0, 600.0)
    assert Ledger.parse(handed.dump()) == (handed, ())


def test_a_handed_place_that_is_never_claimed_comes_back_without_a_failure() -> None:
    policy = Pacing(max_parallel=1, slot_ttl=600)
    ledger = finish(_line_of(policy, ["a", "b", "c"]), "a", CS, 5.0, ok=True)
    handed = pacing.hand_over(policy, ledger, CS, 5.0)
    d = decide(policy, handed, "c", CS, 5.0 + pacing.HANDOFF_TTL, ticket=1)
    assert d.action == "proceed"
    assert d.ledger.failed == {}
    assert d.ledger.holders() == ("c",)
    # a claimed place that lapses counts, as any holder's
    claimed = renew(handed, "b", CS, 10.0, policy.slot_ttl)
    assert claimed is not None
    lost = decide(policy, claimed, "c", CS, 611.0, ticket=1)
    assert lost.ledger.failed == {"b": pacing.LOST}


@pytest.mark.parametrize("why", ["breaker", "canary", "other checksum", "no host", "soak"])
def test_a_place_is_handed_only_where_the_receiver_would_take_it_itself(why: str) -> None:
    policy = Pacing(max_parallel=1, canaries=0, max_failures=1, slot_ttl=600)
    ledger = _line_of(policy, ["a", "b", "c"])
    checksum = CS
    if why == "breaker":
        ledger = finish(ledger, "a", CS, 5.0, ok=False, why="boom")
    elif why == "canary":
        policy = replace(policy, canaries=2)
        ledger = finish(_line_of(policy, ["a", "b", "c"]), "a", CS, 5.0, ok=True)
    elif why == "soak":
        policy = replace(policy, canaries=1, soak=300.0)
        ledger = finish(_line_of(policy, ["a", "b", "c"]), "a", CS, 5.0, ok=True)
    elif why == "other checksum":
        ledger = finish(ledger, "a", CS, 5.0, ok=True)
        checksum = "f" * 64
    else:
        ledger = replace(finish(ledger, "a", CS, 5.0, ok=True), hosts={})
    assert pacing.hand_over(policy, ledger, checksum, 5.0) == ledger


@pytest.mark.parametrize(
    "hosts",
    [
        "x",
        [],
        {"0": 5},
        {"-1": "a"},
        {"99": "a"},
        {"0": ""},
        {"0": "a" * 300},
        {"1e3": "a"},
        {"0" * 40: "a"},
        {"\u00b2": "a"},  # a digit to str.isdigit, not to int()
        {"\u0661": "a"},
        {str(i): "a" for i in range(1001)},
    ],
)
def test_ticket_hosts_that_are_not_a_waiting_tickets_are_dropped(hosts: object) -> None:
    text = json.dumps({"checksum": CS, "line": {"tickets": 2, "turn": 0, "hosts": hosts}})
    ledger, problems = Ledger.parse(text)
    assert ledger.hosts == {}
    assert problems == ()
    assert (ledger.tickets, ledger.turn) == (2, 0)


# -- a pool of nodes stepping in random order --------------------------------------------------


@dataclass
class Node:
    name: str
    state: str = "idle"  # idle -> applying -> done | failed; crashed
    canary: bool = False
    #: its ticket in the line, and its own memory of what it saw when
    ticket: int | None = None
    seen: pacing.Sightings = field(default_factory=pacing.Sightings)
    #: it applies on a place handed to it, not claimed yet
    unclaimed: bool = False


@dataclass
class Pool:
    policy: Pacing
    nodes: list[Node]
    ledger: Ledger = field(default_factory=Ledger)
    now: float = 0.0
    started: set[str] = field(default_factory=set)
    max_applying: int = 0
    #: receivers of a handed place that crashed before they claimed it (the breaker does not
    #: count them: their place lapses as a dead waiter's would)
    unclaimed_crashes: int = 0
    handed: int = 0  # places handed over by the node leaving them


steps = st.lists(
    st.tuples(
        st.sampled_from(["try", "finish", "crash", "tick"]),
        st.integers(0, 7),
        st.floats(0.0, 15.0),
    ),
    max_size=120,
)


def _run(pool: Pool, program: list[tuple[str, int, float]], fails: bool) -> None:
    for action, index, amount in program:
        node = pool.nodes[index % len(pool.nodes)]
        if action == "try" and node.state == "idle":
            d = decide(
                pool.policy, pool.ledger, node.name, CS, pool.now, node.seen, ticket=node.ticket
            )
            pool.ledger, node.ticket = d.ledger, d.ticket
            if d.action == "proceed":
                mine = d.ledger.slot_of(node.name)
                node.state, node.canary = "applying", d.canary
                node.unclaimed = mine is not None and mine.handed
                pool.started.add(node.name)
                if not d.canary:
                    # every canary place is taken, and each live canary soaked, healthy
                    active = [x for x in d.ledger.canaries if x not in d.ledger.failed]
                    assert len(active) >= pool.policy.canaries
                    for canary in active:
                        healthy = d.ledger.healthy[canary]
                        assert healthy + pool.policy.soak <= pool.now
        elif action == "finish" and node.state == "applying":
            ok = not fails
            left = finish(pool.ledger, node.name, CS, pool.now, ok=ok, why="x")
            # the place handed to the first ticket in the same write, if it may take it now
            pool.ledger = pacing.hand_over(pool.policy, left, CS, pool.now, node.seen)
            node.state = "done" if ok else "failed"
            for receiver in pool.ledger.holders():
                if receiver not in left.holders():
                    assert pool.ledger.position(_ticket_of(pool, receiver)) is None  # served
                    pool.handed += 1
        elif action == "crash" and node.state == "applying":
            node.state = "crashed"  # stops renewing; its slot expires
            pool.unclaimed_crashes += node.unclaimed
        elif action == "tick":
            pool.now += amount  # < ttl / 3: a live holder's renewer keeps up
            for other in pool.nodes:
                if other.state == "applying":
                    # a receiver's first renewal claims its handed place (with the pool's ttl)
                    renewed = renew(pool.ledger, other.name, CS, pool.now, pool.policy.slot_ttl)
                    assert renewed is not None, "a live holder lost its slot"
                    pool.ledger, other.unclaimed = renewed, False
        applying = sum(1 for n in pool.nodes if n.state == "applying")
        pool.max_applying = max(pool.max_applying, applying)
        assert len(pool.ledger.slots) <= pool.policy.max_parallel
        assert applying <= pool.policy.max_parallel


def _ticket_of(pool: Pool, host: str) -> int | None:
    return next(n.ticket for n in pool.nodes if n.name == host)


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(1, 3),
    c=st.integers(0, 2),
    f=st.integers(1, 3),
    n=st.integers(1, 8),
    program=steps,
    fails=st.booleans(),
)
def test_pool_never_exceeds_k_nor_f_plus_k_minus_1_on_a_failing_checksum(
    k: int, c: int, f: int, n: int, program: list[tuple[str, int, float]], fails: bool
) -> None:
    policy = Pacing(max_parallel=k, canaries=c, soak=20.0, max_failures=f, slot_ttl=60.0)
    pool = Pool(policy, [Node(f"n{i}") for i in range(n)])
    _run(pool, program, fails)
    if fails:
        # every node that starts fails (or dies): the breaker stops the pool in time (a
        # receiver that died before it claimed its handed place is not counted by it)
        assert len(pool.started) <= f + k - 1 + pool.unclaimed_crashes
    # canary places are only refilled for canaries that failed
    canaries = [x for x in pool.nodes if x.canary]
    assert len(canaries) <= c + len(pool.ledger.failed)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 8), k=st.integers(1, 3), c=st.integers(0, 2))
def test_a_healthy_pool_converges(n: int, k: int, c: int) -> None:
    policy = Pacing(max_parallel=k, canaries=c, soak=20.0, max_failures=1, slot_ttl=60.0)
    pool = Pool(policy, [Node(f"n{i}") for i in range(n)])
    for _ in range(4 * n + 10):
        program = [("try", i, 0.0) for i in range(n)] + [("finish", i, 0.0) for i in range(n)]
        _run(pool, [*program, ("tick", 0, 15.0)], fails=False)
    assert all(x.state == "done" for x in pool.nodes)
    assert pool.max_applying <= k
    if n > k + c:  # past the canaries, nodes waiting in line are handed the places that free
        assert pool.handed > 0


# -- hostile ledgers and Leases: the writer's clock and numbers are not trusted ----------------

NOW = 1_800_000_000.0
YEAR = 365 * 86400.0
POLICY = Pacing(max_parallel=1, slot_ttl=60.0)


@pytest.mark.parametrize("ttl", [math.nan, math.inf, 1e300, -5.0, 0.0])
def test_a_slot_with_a_ttl_that_is_no_duration_does_not_hold_the_pool(ttl: float) -> None:
    """Live, a NaN ttl held the update while the waiting node made 130 requests in 20 s."""
    text = json.dumps({"slots": [{"host": "ghost", "checksum": CS2, "renewed": NOW, "ttl": ttl}]})
    first = decide(POLICY, Ledger.load(text), "me", CS, NOW)
    assert first.action == "wait"
    assert first.retry_in is not None
    assert 0.0 < first.retry_in <= pacing.MAX_SLOT_TTL
    later = decide(POLICY, Ledger.load(text), "me", CS, NOW + pacing.MAX_SLOT_TTL + 1)
    assert later.action == "proceed", later


def test_a_slot_renewed_a_year_ahead_expires_ttl_after_this_reader_first_saw_it() -> None:
    ghost = Slot("ghost", CS2, NOW + YEAR, 60.0)
    seen = pacing.Sightings()
    first = decide(POLICY, Ledger(CS, (ghost,)), "me", CS, NOW, seen)
    assert first.action == "wait"
    assert first.retry_in == pytest.approx(60.0)
    assert first.ledger.slots[0].renewed == NOW  # written back: repaired for every reader
    assert decide(POLICY, Ledger(CS, (ghost,)), "me", CS, NOW + 59, seen).action == "wait"
    assert decide(POLICY, Ledger(CS, (ghost,)), "me", CS, NOW + 61, seen).action == "proceed"
    # a renewal that changes the record counts from when this reader saw it change
    moved = Slot("ghost", CS2, NOW + 2 * YEAR, 60.0)
    assert decide(POLICY, Ledger(CS, (moved,)), "me", CS, NOW + 100, seen).action == "wait"
    assert decide(POLICY, Ledger(CS, (moved,)), "me", CS, NOW + 161, seen).action == "proceed"


def test_a_writer_slightly_ahead_is_believed_within_the_skew() -> None:
    ahead = Slot("ghost", CS2, NOW + pacing.CLOCK_SKEW / 2, 60.0)
    d = decide(POLICY, Ledger(CS, (ahead,)), "me", CS, NOW, pacing.Sightings())
    assert d.retry_in == pytest.approx(60.0 + pacing.CLOCK_SKEW / 2)


def test_a_canary_healthy_in_year_9999_does_not_stretch_the_soak() -> None:
    policy = Pacing(max_parallel=2, canaries=1, soak=30.0)
    ledger = Ledger(CS, (), ("c1",), {"c1": 253402300799.0}, {})
    seen = pacing.Sightings()
    d = decide(policy, ledger, "me", CS, NOW, seen)
    assert (d.action, d.reason) == ("wait", pacing.REASON_CANARIES)
    assert d.retry_in == pytest.approx(30.0)
    assert decide(policy, ledger, "me", CS, NOW + 31, seen).action == "proceed"


def test_a_canary_without_slot_or_result_is_lost_not_waited_for() -> None:
    policy = Pacing(max_parallel=2, canaries=1, max_failures=2)
    d = decide(policy, Ledger(CS, (), ("ghost",), {}, {}), "me", CS, NOW)
    assert d.action == "proceed"
    assert d.canary  # the ghost's canary place is taken by a live node
    assert d.ledger.failed == {"ghost": pacing.LOST}


def test_a_serial_lease_renewed_in_year_9999_for_68_years_expires_by_our_duration() -> None:
    spec = {
        "holderIdentity": "ghost",
        "renewTime": "9999-12-31T23:59:59.000000Z",
        "leaseDurationSeconds": 2**31 - 1,
    }
    seen = pacing.Sightings()
    wait = pacing.serial_step(spec, "me", NOW, 600, seen)
    assert wait.action == "wait"
    assert wait.expires_in == pytest.approx(600.0)
    assert pacing.serial_step(spec, "me", NOW + 599, 600, seen).action == "wait"
    assert pacing.serial_step(spec, "me", NOW + 601, 600, seen).action == "acquire"


def test_ledger_problems_are_named() -> None:
    ledger, problems = Ledger.parse("{not json")
    assert ledger == Ledger()
    assert problems[0].startswith("not JSON")
    ledger, problems = Ledger.parse(
        '{"slots": [{"host": "a", "renewed": 1, "ttl": NaN}, {"host": 7}, {"host": "a"}]}'
    )
    assert ledger.holders() == ("a",)
    assert problems == (
        "slot of a has renewed=1.0 ttl=nan",
        "slot 1 has no host",
        "slot 2 repeats host 'a'",
    )
    assert Ledger.parse("[]")[1] == ("not a JSON object but list",)
    for window in ("1e300", "-3", "NaN", '"wide"'):
        ledger, problems = Ledger.parse(f'{{"window": {window}}}')
        assert ledger.window == 0.0
        assert problems[0].startswith("window ")
        assert "out of range" in problems[0]


def test_the_pools_join_window_follows_how_soon_the_first_join_came() -> None:
    floor, target = 4.0, pacing.JOIN_TARGET
    fresh = Ledger(CS)
    # the first join came 0.04 s into a 4 s window: ~100 nodes outside, the window widens
    # (by the square root of the ratio, at most 4 x at once)
    wide = pacing.learn_window(fresh, 4.0, 0.04, floor)
    assert wide.window == 16.0
    assert pacing.learn_window(wide, 16.0, target / 9, floor).window == pytest.approx(48.0)
    # a join that came late narrows it (at most by half), down to none learned at the floor
    assert pacing.learn_window(Ledger(CS, window=100.0), 100.0, 99.0, floor).window == 50.0
    assert pacing.learn_window(Ledger(CS, window=6.0), 6.0, 5.0, floor).window == 0.0
    assert '"window"' not in pacing.learn_window(fresh, 4.0, 3.0, floor).dump()
    assert pacing.learn_window(fresh, 3000.0, 0.001, floor).window == pacing.MAX_JOIN_WINDOW
    # a node that lost a race before its join landed: twice the pool's window it drew from, or
    # the pool's as it is now if wider (its own wait, in its backed-off window, says nothing)
    assert pacing.learn_window(Ledger(CS, window=10.0), 10.0, 0.5, floor, lost=True).window == 20.0
    assert pacing.learn_window(Ledger(CS, window=50.0), 10.0, 99.0, floor, lost=True).window == 50.0
    # the window is the pool's: a new checksum keeps it, as the pool's size stays
    assert pacing.for_checksum(wide, CS2).window == 16.0
    assert Ledger.load(wide.dump()).window == 16.0


def _join_races(outside: int, seen_after: float, seed: int, joins: int) -> tuple[int, int]:
    """A model of the join races: ``outside`` nodes wait outside the line; each draws its delay
    in the pool's window (doubled for a node that lost its last race), the first writes, and
    every node whose delay ends before that write is seen (``seen_after`` s) writes and loses.
    The node whose join landed teaches the pool's window how soon it came. Returns the joins
    and the writes lost."""
    import random

    rng = random.Random(seed)
    ledger, floor, own = Ledger(CS), 4.0, {n: 0.0 for n in range(outside)}
    lost = done = 0
    while len(own) > 1 and done < joins:
        pool = max(ledger.window, floor)
        draws = sorted((rng.uniform(0.0, max(pool, own[n])), n, max(pool, own[n])) for n in own)
        first_at, first, window = draws[0]
        losers = [n for at, n, _ in draws[1:] if at < first_at + seen_after]
        lost_before = own.pop(first) > 0.0
        # a node that lost before teaches twice the pool's window it drew from at first
        taught = pool if lost_before else window
        ledger = pacing.learn_window(ledger, taught, first_at, floor, lost=lost_before)
        for n in losers:
            own[n] = min(2 * max(pool, own[n]), pacing.MAX_JOIN_WINDOW)
        lost += len(losers)
        done += 1
    return done, lost


@pytest.mark.parametrize("outside", [20, 80, 400, 2000])
def test_a_learned_join_window_keeps_lost_joins_flat_in_the_pool_size(outside: int) -> None:
    """Lost writes per join, in the model, for a write seen after 0.1 s: with the learned
    window they stay low at every size; with the fixed 4 s window of before they grow with the
    number outside (about n x 0.1 / 4, i.e. 5 per join at 2,000 outside)."""
    joins = lost = 0
    for seed in range(3):
        j, n = _join_races(outside, 0.1, seed, joins=min(outside - 1, 300))
        joins, lost = joins + j, lost + n
    assert lost / joins < 0.35, (outside, lost, joins)


def test_a_pool_counts_its_joins_and_sizes_the_next_window_by_them() -> None:
    """Each join is counted in the ledger; a new checksum takes the count as the pool's size,
    and the window a node outside draws in is then one JOIN_TARGET per node still outside."""
    ledger = Ledger(CS)
    assert pacing.join_window(ledger) == 0.0  # nothing known: the caller's floor
    for _ in range(40):
        ledger = pacing.count_join(ledger)
    assert (ledger.joined, ledger.pool) == (40, 0)
    assert Ledger.load(ledger.dump()) == ledger
    nxt = pacing.for_checksum(ledger, CS2)
    assert (nxt.joined, nxt.pool) == (0, 40)
    assert pacing.join_window(nxt) == 40 * pacing.JOIN_TARGET
    later = pacing.count_join(pacing.count_join(nxt))
    assert pacing.join_window(later) == 38 * pacing.JOIN_TARGET
    # more joins than the count (the pool grew): one node's worth, the caller's floor above it
    grown = replace(later, joined=45)
    assert pacing.join_window(grown) == pacing.JOIN_TARGET
    # a checksum nobody joined for keeps the size known before
    assert pacing.for_checksum(nxt, CS).pool == 40
    # the first joiner of a pool that never counted writes the count it made; a known size
    # is not overwritten
    assert pacing.count_join(Ledger(CS), counted=100).pool == 100
    assert pacing.count_join(nxt, counted=7).pool == 40
    assert pacing.count_join(Ledger(CS), counted=10**9).pool == pacing.MAX_POOL
    # a large pool's window is capped like a learned one
    huge = Ledger(CS, pool=pacing.MAX_POOL)
    assert pacing.join_window(huge) == pacing.MAX_JOIN_WINDOW
    # the wire form is as before while nothing is counted
    assert '"joined"' not in Ledger(CS).dump()
    assert '"pool"' not in Ledger(CS).dump()


@pytest.mark.parametrize("raw", ["-1", "5001", '"40"', "true", "1.5", "1e300", "null"])
def test_a_count_that_is_not_one_is_forgotten_and_named(raw: str) -> None:
    ledger, problems = Ledger.parse(f'{{"checksum": "{CS}", "pool": {raw}, "joined": 3}}')
    assert (ledger.pool, ledger.joined) == (0, 3)
    if raw == "null":  # absent and null read alike (nothing counted)
        assert problems == ()
        return
    assert problems == (f"pool {json.loads(raw)} is not a count of nodes (forgotten)",)


def _sized_join_races(outside: int, seen_after: float, seed: int, joins: int) -> tuple[int, int]:
    """The model of :func:`_join_races` in a pool that knows its size: every node outside
    draws in ``pacing.join_window`` (one JOIN_TARGET per node still outside, the 4 s floor
    under it); a node that lost draws again in the same window (its own doubles from the
    floor only). Returns the joins and the writes lost."""
    import random

    rng = random.Random(seed)
    ledger, floor = Ledger(CS, pool=outside), 4.0
    own = dict.fromkeys(range(outside), floor)
    lost = done = 0
    while len(own) > 1 and done < joins:
        pool = max(pacing.join_window(ledger), floor)
        draws = sorted((rng.uniform(0.0, max(pool, own[n])), n) for n in own)
        first_at, first = draws[0]
        losers = [n for at, n in draws[1:] if at < first_at + seen_after]
        own.pop(first)
        ledger = pacing.count_join(ledger)
        for n in losers:
            own[n] = min(2 * own[n], pacing.MAX_JOIN_WINDOW)
        lost += len(losers)
        done += 1
    return done, lost


@pytest.mark.parametrize("outside", [20, 80, 400, 2000, 5000])
def test_a_sized_join_window_keeps_lost_joins_flat_in_the_pool_size(outside: int) -> None:
    """Lost writes per join, in the model, for a write seen after 0.1 s, in a pool that knows
    its size: about 0.1 / JOIN_TARGET at every size, with nothing to learn first (the learned
    window of the model above needs the first joins of a rollout to find its size). Above
    3,600 nodes the window's one-hour cap spaces the first joins closer (0.15 at 5,000)."""
    joins = lost = 0
    for seed in range(2):
        j, n = _sized_join_races(outside, 0.1, seed, joins=min(outside - 1, 300))
        joins, lost = joins + j, lost + n
    assert lost / joins < (0.16 if outside <= 3600 else 0.2), (outside, lost, joins)


# any JSON, and ledger-shaped JSON with hostile numbers and strings
_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([253402300799.0, 1e300, -1e300, NOW + YEAR]),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
)
_json = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
_hosts = st.sampled_from(["a", "b", "me", "ghost", ""]) | st.text(max_size=4) | st.integers()
_slot = st.fixed_dictionaries(
    {},
    optional={
        "host": _hosts,
        "checksum": st.sampled_from([CS, CS2]) | _json,
        "renewed": _numbers,
        "ttl": _numbers,
        "canary": _json,
        "handed": _json,
    },
)
_line = st.fixed_dictionaries(
    {},
    optional={
        "tickets": _numbers,
        "turn": _numbers,
        "served": st.lists(_numbers, max_size=3) | _json,
        "hosts": st.dictionaries(st.text(max_size=4), _hosts, max_size=4) | _json,
    },
)
_ledger = st.fixed_dictionaries(
    {},
    optional={
        "checksum": st.sampled_from([CS, CS2, ""]) | _json,
        "slots": st.lists(_slot, max_size=6) | _json,
        "canaries": st.lists(_hosts, max_size=4) | _json,
        "healthy": st.dictionaries(st.sampled_from(["a", "b", "ghost"]), _numbers) | _json,
        "failed": st.dictionaries(st.sampled_from(["a", "b", "ghost"]), _json) | _json,
        "window": _numbers,
        "line": _line | _json,
        "joined": _numbers | st.integers(0, pacing.MAX_POOL),
        "pool": _numbers | st.integers(0, pacing.MAX_POOL),
    },
)


@settings(max_examples=400, deadline=None)
@given(doc=st.one_of(_ledger, _json), counted=st.integers(-(2**40), 2**40))
def test_any_ledgers_count_sizes_a_bounded_window(doc: Any, counted: int) -> None:
    """Whatever a ledger says of the pool's count, the window a node draws in stays within
    [0, MAX_JOIN_WINDOW], the counts within [0, MAX_POOL], and the wire form reads back."""
    ledger, _ = Ledger.parse(json.dumps(doc))
    joined = pacing.count_join(ledger, counted=counted)
    for record in (ledger, pacing.for_checksum(ledger, CS2), joined):
        assert 0.0 <= pacing.join_window(record) <= pacing.MAX_JOIN_WINDOW
        assert 0 <= record.joined <= pacing.MAX_POOL
        assert 0 <= record.pool <= pacing.MAX_POOL
        assert Ledger.load(record.dump()).pool == record.pool
        assert Ledger.load(record.dump()).joined == record.joined


@settings(max_examples=400, deadline=None)
@given(
    doc=st.one_of(_ledger, _json),
    k=st.integers(1, 3),
    c=st.integers(0, 2),
    f=st.integers(1, 3),
    ttl=st.floats(1.0, 120.0),
    soak=st.floats(0.0, 120.0),
)
def test_any_ledger_never_raises_never_waits_for_ever_never_exceeds_k(
    doc: object, k: int, c: int, f: int, ttl: float, soak: float
) -> None:
    policy = Pacing(max_parallel=k, canaries=c, soak=soak, max_failures=f, slot_ttl=ttl)
    text = json.dumps(doc)
    ledger, _problems = Ledger.parse(text)
    seen = pacing.Sightings()
    bound = pacing.MAX_SLOT_TTL + pacing.CLOCK_SKEW + soak
    now = NOW
    ticket: int | None = None
    for _ in range(4):
        # a slot of ours for this checksum, live as this reader believes it: deciding renews it
        # (a holder goes on even when the ledger lists more holders than K, e.g. K was lowered)
        live = pacing.current(ledger, CS, now, ttl, copy.deepcopy(seen))
        renewing = any(s.host == "me" and s.checksum == CS for s in live.slots)
        d = decide(policy, ledger, "me", CS, now, seen, ticket=ticket)
        ticket = d.ticket
        if d.action == "proceed":
            # never a new holder beyond K
            assert renewing or len(d.ledger.slots) <= k
            assert len(d.ledger.slots) <= max(k, len(live.slots))
            assert "me" in d.ledger.holders()
            break
        if d.reason == pacing.REASON_BREAKER:
            break  # held by recorded failures until the Secret changes: by design
        # every other wait ends by time alone, within the bound
        assert d.retry_in is not None, d
        assert 0.0 <= d.retry_in <= bound, d
        ledger = Ledger.load(d.ledger.dump())  # written back, read again
        now += d.retry_in + 0.001
    else:
        raise AssertionError(f"still waiting after {now - NOW:.0f}s: {d}")
    assert now - NOW <= 3 * bound


@settings(max_examples=400, deadline=None)
@given(
    doc=st.one_of(_ledger, _json),
    k=st.integers(1, 3),
    ok=st.booleans(),
    ttl=st.floats(1.0, 120.0),
)
def test_any_ledger_handed_on_never_raises_and_never_exceeds_k(
    doc: object, k: int, ok: bool, ttl: float
) -> None:
    """Whatever the pool wrote, the node leaving its place ("a") writes a ledger whose new
    holder (if any) is the host of the first waiting ticket, handed for HANDOFF_TTL at most,
    and never more holders than K (or than the live ones it found)."""
    policy = Pacing(max_parallel=k, canaries=0, max_failures=3, slot_ttl=ttl)
    ledger = Ledger.load(json.dumps(doc))
    left = finish(ledger, "a", CS, NOW, ok=ok, why="x")
    handed = pacing.hand_over(policy, left, CS, NOW, pacing.Sightings())
    new = [s for s in handed.slots if s.host not in left.holders()]
    assert len(new) <= 1
    if not new:
        assert handed == left  # nobody to hand to: the ledger as the node left it
    for slot in new:
        assert len(handed.slots) <= k
        head = left.head()
        assert head is not None
        assert slot.host == left.hosts[head]
        assert slot.handed
        assert slot.ttl == min(pacing.HANDOFF_TTL, ttl)
        assert handed.position(head) is None  # served
    assert Ledger.load(handed.dump()).dump() == handed.dump()  # what is written reads back


@settings(max_examples=300, deadline=None)
@given(
    holder=st.none() | st.text(max_size=6),
    renew=st.none()
    | st.text(max_size=30)
    | st.sampled_from(
        ["9999-12-31T23:59:59.000000Z", "2026-01-01T00:00:00Z", "0001-01-01T00:00:00Z"]
    ),
    seconds=_numbers,
    duration=st.integers(1, 600),
)
def test_any_serial_lease_never_raises_and_expires_within_our_duration(
    holder: str | None, renew: str | None, seconds: object, duration: int
) -> None:
    spec = {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": seconds}
    seen = pacing.Sightings()
    step = pacing.serial_step(spec, "me", NOW, duration, seen)
    if step.action == "wait":
        assert 0.0 < step.expires_in <= duration + pacing.CLOCK_SKEW
        later = NOW + step.expires_in + 0.001
        assert pacing.serial_step(spec, "me", later, duration, seen).action == "acquire"


# -- the line: only the next tickets act ------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 12),
    k=st.integers(1, 3),
    dead=st.sets(st.integers(0, 11), max_size=4),
    order=st.randoms(use_true_random=False),
)
def test_a_line_serves_every_live_node_with_a_bounded_number_of_writes(
    n: int, k: int, dead: set[int], order: Any
) -> None:
    """Nodes look at the ledger after every change, in random order; a node writes only when
    its decision changes the ledger; a node draws a ticket only into a line shorter than 2K.
    Waiters that die after drawing a ticket are passed over:
    every live node applies (no deadlock), never more than K at once, each live node writes at
    most 3 times (its ticket, its slot, its result) plus once per time the line passed it for
    the dead ahead of it, and a node holding a waiting ticket writes only to take its slot."""
    policy = Pacing(max_parallel=k, slot_ttl=600.0)
    names = [f"n{i}" for i in range(n)]
    ledger, now = Ledger(), 0.0
    tickets: dict[str, int | None] = dict.fromkeys(names)
    seen = {name: pacing.Sightings() for name in names}
    state = dict.fromkeys(names, "idle")
    writes = dict.fromkeys(names, 0)
    passed = dict.fromkeys(names, 0)
    for _ in range(60 * n + 100):
        if all(state[x] in ("done", "dead") for x in names):
            break
        now += 1.0
        turn = list(names)
        order.shuffle(turn)
        for name in turn:
            if state[name] == "applying":
                ledger = finish(ledger, name, CS, now, ok=True)
                state[name], writes[name] = "done", writes[name] + 1
            elif state[name] in ("idle", "drawn"):
                d = decide(policy, ledger, name, CS, now, seen[name], ticket=tickets[name])
                held = ledger.position(tickets[name]) is not None
                if tickets[name] is not None and not held and d.ticket != tickets[name]:
                    # passed over (the line widened past it for dead tickets ahead): it lets
                    # its ticket go, now or when it draws again
                    passed[name] += d.action != "proceed"
                if d.ledger != ledger:
                    # a node holding a waiting ticket writes only to take its slot; one passed
                    # over draws again
                    assert d.action == "proceed" or not held, (name, d)
                    if d.action == "wait":
                        # a draw joins a short line (only a line stalled by the dead ahead
                        # lets the rest join behind it): the pool does not race to draw
                        assert ledger.waiting() < pacing.JOIN_DEPTH * k or dead, (name, ledger)
                    ledger, writes[name] = d.ledger, writes[name] + 1
                tickets[name] = d.ticket
                if d.action == "proceed":
                    state[name] = "applying"
                elif int(name[1:]) in dead:
                    state[name] = "dead"  # drew its ticket, then its agent died
            assert len(ledger.slots) <= k
            assert sum(1 for x in names if state[x] == "applying") <= k
            assert ledger.waiting() <= pacing.JOIN_DEPTH * k or dead, ledger
    live = [x for x in names if int(x[1:]) not in dead or state[x] == "done"]
    assert all(state[x] == "done" for x in live), (state, ledger)
    assert all(writes[x] <= 3 + passed[x] for x in live), writes
    assert all(passed[x] <= len(dead) for x in live), passed
