"""Rollout coordination of the OSC controller: serial mode and the paced rollout, on the Lease.

The decisions are :mod:`node_agent.controllers.osc.pacing`'s; this module reads and writes the one
Lease ``kube-system/<secretName>`` (the only shared object Gardener lets a node agent write),
reports where the node stands (Node condition ``OSCRollout``, Warning Events, logs,
:meth:`view`) and wakes the reconcile loop when a waiting node should look again.

The OSC controller asks :meth:`Rollout.admit` before it applies an update; ``None`` means wait
(the loop is woken later, with jitter, or at once when the Secret changes). A :class:`Permit`
is held over the apply and the health gate's verdict, then given back with
:meth:`Rollout.succeeded` or :meth:`Rollout.failed`. Nothing is held in memory that the pool
depends on: a slot lives only while its holder renews it, so a killed agent loses it by expiry.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from node_agent.base import retry
from node_agent.base.errors import KubeConflict, KubeError, KubeNotFound
from node_agent.base.log import get_logger
from node_agent.base.loop import cancel_and_wait
from node_agent.base.retry import Backoff
from node_agent.config import RolloutConfig
from node_agent.controllers.osc import pacing
from node_agent.controllers.osc.pacing import Decision, Ledger, Policy
from node_agent.kube import report
from node_agent.kube.watch import list_watch

if TYPE_CHECKING:
    from node_agent.context import AgentContext
    from node_agent.osc.plan import ChangeSet

log = get_logger("node-agent.rollout")

JSON = dict[str, Any]
T = TypeVar("T")

CAS_ATTEMPTS = 8
#: a waiting node that sees the Lease change looks again after a random delay up to this (so a
#: freed slot is not raced for by the whole pool in the same instant)
WATCH_SPREAD = 1.0
#: A condition whose status and reason stay the same is rewritten for a new message (the holders
#: changed, the soak went on) at most this often: each holder change wakes every waiting node,
#: and a write per wake-up made a paced rollout cost each node ~100 extra API requests.
MESSAGE_REFRESH = 60.0
#: A waiting node never decides again sooner than this after its last look at the Lease, however
#: often the Lease changes or however soon a slot seems to expire: no path spins on the API
#: (``recheckMin`` lowers it, down to ``RECHECK_FLOOR``).
MIN_RECHECK = 1.0
RECHECK_FLOOR = 0.05
#: A node joining the line (drawing a ticket, or taking a free place without one) writes after a
#: random delay up to its window, and only if the Lease its watch shows by then still asks for
#: it: the first to write fills the line and the others stand down without a request. Its window
#: is the pool's, as the ledger keeps it (``pacing.learn_window``: each join that lands narrows
#: or widens it, so that it follows the number of nodes outside the line), never below
#: JOIN_WINDOW; a 409 on such a write doubles the node's own (up to JOIN_WINDOW_MAX) until one
#: of its writes lands, which then widens the pool's.
JOIN_WINDOW = 4.0
JOIN_WINDOW_MAX = pacing.MAX_JOIN_WINDOW
#: Nodes per page when a pool counts itself (``_count_pool``)
POOL_PAGE = 500
#: a timer may fire this much before its time (the loop's clock resolution, float rounding)
TIMER_SLACK = 0.05
State = Literal["idle", "waiting", "applying", "applied", "failed"]


class _Contended(Exception):
    """A compare-and-swap on the Lease lost a race (409): the watch brings the Lease that won,
    and the node decides again from it instead of reading it again."""


class _Deferred(Exception):
    """A first look's join is due later than the node may hold its reconcile loop: it waits
    (watching) and joins when its delay is over, if the line still needs it then."""


@dataclass(frozen=True)
class RolloutView:
    """Where this node stands in its pool's rollout (``node-agent status``, metrics)."""

    serial: bool = False
    #: the paced rollout's policy in words, or None when the Secret does not ask for one
    pacing: str | None = None
    state: State = "idle"
    #: why the node waits (WaitingForSerialLease, WaitingForSlot, WaitingForCanaries,
    #: CircuitBreakerOpen), or the last outcome's reason
    reason: str | None = None
    message: str = ""
    checksum: str | None = None
    #: nodes holding a slot / the serial Lease, as last read
    holders: tuple[str, ...] = ()
    canaries: tuple[str, ...] = ()
    failures: int = 0
    breaker_open: bool = False
    #: this node holds a canary slot
    canary: bool = False
    since: float | None = None
    waits: int = 0
    #: compare-and-swap writes of the pool's Lease that lost their race (409), by what the
    #: write was for (``join``, ``take``, ``result``, ...): where a rollout's conflicts come from
    conflicts: tuple[tuple[str, int], ...] = ()
    #: annotations of the Secret that could not be read (defaults used)
    problems: tuple[str, ...] = ()


@dataclass
class Permit:
    """What this node holds while it applies ``checksum``."""

    checksum: str
    serial: bool = False
    slot: bool = False
    canary: bool = False
    renewer: asyncio.Task[None] | None = field(default=None, repr=False)
    #: the paced rollout's policy the slot was taken under (its place is handed on with it)
    pacing: pacing.Pacing | None = field(default=None, repr=False)


class Rollout:
    def __init__(
        self,
        ctx: AgentContext,
        wake: Callable[[], None],
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.ctx = ctx
        self._wake = wake
        self.clock = clock
        self._rng = rng or random.Random()
        self._permit: Permit | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._view = RolloutView()
        self._reported: tuple[str, str, str] | None = None  # condition last written
        self._reported_at = 0.0  # when (time.monotonic)
        self._announced: tuple[str, str] | None = None  # (reason, checksum) of the last Event
        self._problems_logged: tuple[str, ...] = ()
        self._owner: Mapping[str, Any] = {}  # the Secret: the owner of a Lease we create
        self._watcher: asyncio.Task[None] | None = None  # the Lease's watch, while waiting
        self._decided_on: str | None = None  # resourceVersion of the Lease last read/written
        self._known: JSON | None = None  # the Lease as this node last read or wrote it
        self._watched: str | None = None  # resourceVersion the watch last showed
        # the Lease as the watch last showed it (None: not watching, or not shown yet): a
        # waiting node decides from it, without a request, and writes on its resourceVersion
        self._shown: JSON | None = None
        # what this node waits for, to judge each change the watch shows (policy, checksum)
        self._waiting_for: tuple[Policy, str] | None = None
        # its ticket in the pool's line: (the ledger's checksum, number)
        self._ticket: tuple[str, int] | None = None
        # when this node first saw each record other nodes wrote (their clocks are not ours)
        self._seen_serial = pacing.Sightings()
        self._seen_slots = pacing.Sightings()
        self._looked_at = -math.inf  # loop time of the last read of the Lease
        self._window = JOIN_WINDOW  # this node's join window (doubled per lost race)
        self._pool_window = 0.0  # the pool's join window, as the last ledger seen says
        self._pool_sized = False  # the last ledger seen knew the pool's size (its window is n s)
        self._counted: int | None = None  # the pool's Nodes as this node counted them (once)
        # the ledger last seen and since when it has not changed (by this node's clock)
        self._still: tuple[Ledger | None, float] = (None, 0.0)
        self._sized_by: tuple[str, int] | None = None  # (checksum, pool) the window is sized by
        self._distrusted: tuple[str, int] | None = None  # a size that left the line standing
        self._drew_at = 0.0  # when this node drew its pending join delay
        self._drawn_so_far = 0  # tickets the pool had drawn, as the last ledger seen says
        self._join_at: float | None = None  # loop time this node's join is due (drawn)
        # when this node drew its join delay: (loop time, the window it drew from, tickets the
        # pool had drawn, the pool's window)
        self._join_drawn: tuple[float, float, int, float] | None = None
        #: a first look's join is pending: the watch runs for it without judging (the node is
        #: not waiting yet, and decides itself once its delay is over)
        self._joining = False
        self._looked_for: str | None = None  # the checksum of this node's last first look
        self._lost_on: str | None = None  # resourceVersion a write of ours lost its race on
        self._ledger_problems: tuple[str, ...] = ()  # of the last ledger reset reported
        # our condition's (status, lastTransitionTime) as last written or seen on the Node
        self._on_node: tuple[str, str] | None = None
        self._conflicts: Counter[str] = Counter()  # lost compare-and-swap writes, by kind

    @property
    def config(self) -> RolloutConfig:
        return self.ctx.config.node_agent.rollout

    @property
    def lease_name(self) -> str:
        """Gardener's name for the serial Lease: the OSC Secret's."""
        return self.ctx.secret_name

    def view(self) -> RolloutView:
        return replace(self._view, conflicts=tuple(sorted(self._conflicts.items())))

    async def close(self) -> None:
        """Stop the timer, the Lease's watch and a slot's renewer (the slot then lapses)."""
        self._stop_timer()
        watcher, self._watcher = self._watcher, None
        await cancel_and_wait(watcher, self._permit.renewer if self._permit else None)
        self._permit = None

    @staticmethod
    def policy(secret: Mapping[str, Any]) -> Policy:
        return pacing.parse_policy((secret.get("metadata") or {}).get("annotations"))

    def skips_delay(self, secret: Mapping[str, Any]) -> bool:
        """Serial mode has no reconciliation delay (the Lease spreads the nodes out)."""
        return self.policy(secret).serial

    # -- admission ------------------------------------------------------------------------------

    async def admit(
        self,
        secret: Mapping[str, Any],
        checksum: str,
        *,
        retrying: bool,
        plan: Callable[[], Awaitable[ChangeSet]],
    ) -> Permit | None:
        """Before an update is applied: the permit to apply it, or None (wait; the reconcile
        loop is woken again later). A retry of a partly applied update is not paced again (the
        node is already in the middle of it, and was counted), but serial mode renews its Lease
        on every try, as Gardener's agent does."""
        self._stop_timer()
        # A retry after an error we were not told about (the apply did not end in success or
        # failure): the slot taken for this checksum is still ours and still renewed.
        kept = self._permit
        if kept is not None and kept.checksum == checksum and retrying:
            self._permit = None
        else:
            kept = None
            await self._drop_permit(superseded_by=checksum)
        policy = self.policy(secret)
        self._owner = secret
        if policy.problems != self._problems_logged:
            self._problems_logged = policy.problems
            if policy.problems:
                log.warning(
                    "rollout annotations not understood; defaults used", problems=policy.problems
                )
        self._set(
            serial=policy.serial,
            pacing=policy.pacing.describe() if policy.pacing else None,
            problems=policy.problems,
            checksum=checksum,
        )
        permit = Permit(checksum)
        if kept is not None and kept.slot:
            permit.slot, permit.canary, permit.renewer = True, kept.canary, kept.renewer
            permit.pacing = kept.pacing
        # held from here on, so that an API error below leaves nothing running unaccounted
        self._permit = permit
        if not policy.active:
            self._stop_watch()
            await self._drop_permit()
            self._set(state="idle", reason=None, message="", holders=(), canary=False)
            return Permit(checksum)
        if policy.serial:
            self._waiting_for = (policy, checksum)
            waited = await self._serial_acquire(checksum)
            if waited:
                await self._drop_permit()  # a kept slot lapses (counted as lost)
                return None
            permit.serial = True
        if policy.pacing is not None and not retrying:
            disruptive = pacing.disruptive_units((await plan()).unit_commands)
            if disruptive:
                decision = await self._take_slot(policy.pacing, checksum, serial=policy.serial)
                if decision.action == "wait":
                    await self._drop_permit()
                    if permit.serial:
                        await self._serial_release()
                    self._waiting_for = (policy, checksum)
                    await self._wait(
                        decision.reason or "", decision.message, checksum, decision.retry_in
                    )
                    return None
                permit.slot, permit.canary = True, decision.canary
                permit.pacing = policy.pacing
                mine = decision.ledger.slot_of(self.ctx.host_name)
                handed = mine is not None and mine.handed
                permit.renewer = self._start_renewer(checksum, policy.pacing.slot_ttl, claim=handed)
                log.info(
                    "rollout slot handed over" if handed else "rollout slot taken",
                    checksum=checksum,
                    canary=decision.canary,
                    units=disruptive,
                    holders=decision.ledger.holders(),
                )
        elif policy.pacing is not None and not permit.slot:
            # resuming after the agent restarted mid-apply: a slot still ours is taken up again
            slot = await self._readopt(checksum, policy.pacing.slot_ttl)
            if slot is not None:
                permit.slot, permit.canary, permit.pacing = True, slot.canary, policy.pacing
                permit.renewer = self._start_renewer(checksum, policy.pacing.slot_ttl)
                log.info("rollout slot taken up again", checksum=checksum)
        message = f"applying OSC {checksum[:12]}"
        if permit.canary:
            message += " as a canary"
        if permit.slot:
            message += " (rollout slot held)"
        if permit.serial:
            message += " (serial Lease held)"
        await self._proceed(
            checksum, message, canary=permit.canary, writes_again=permit.slot or permit.serial
        )
        return permit

    async def succeeded(self, permit: Permit | None) -> None:
        """Applied and healthy (the gate's verdict): the slot freed with a success recorded;
        the serial Lease released (Gardener releases it after a successful apply only)."""
        if permit is None:
            return
        self._permit = None
        await self._stop_renewer(permit)
        if permit.slot:
            await self._finish(permit.checksum, _handing(permit), ok=True, why="")
        if permit.serial:
            await self._serial_release()
        self._stop_watch()
        if permit.slot or permit.serial:
            message = f"OSC {permit.checksum[:12]} applied and healthy"
            self._set(state="applied", reason=report.REASON_ROLLOUT_APPLIED, message=message)
            await self._condition("True", report.REASON_ROLLOUT_APPLIED, message)

    async def failed(self, permit: Permit | None, why: str) -> None:
        """The update failed or was rolled back: recorded against its checksum (the breaker
        counts it) and the slot freed. The serial Lease stays ours, as in Gardener's agent (a
        retry renews it; a node that gives up lets it expire)."""
        if permit is None:
            return
        self._permit = None
        await self._stop_renewer(permit)
        if permit.slot:
            await self._finish(permit.checksum, _handing(permit), ok=False, why=why)
        self._stop_watch()
        if permit.slot or permit.serial:
            message = f"OSC {permit.checksum[:12]} failed: {why}"
            self._set(state="failed", reason=report.REASON_ROLLOUT_FAILED, message=message)
            await self._condition("False", report.REASON_ROLLOUT_FAILED, message)

    async def up_to_date(self, checksum: str) -> None:
        """The node already runs ``checksum``: a permit still open for it (the apply finished,
        reporting it did not) is given back as a success; a stale wait is cleared."""
        permit = self._permit
        if permit is not None and permit.checksum == checksum:
            await self.succeeded(permit)
            return
        await self._drop_permit()
        if self._view.state == "waiting":
            self._stop_timer()
            self._stop_watch()
            message = f"OSC {checksum[:12]} is applied"
            self._set(state="applied", reason=report.REASON_ROLLOUT_APPLIED, message=message)
            await self._condition("True", report.REASON_ROLLOUT_APPLIED, message)

    # -- serial mode -----------------------------------------------------------------------------

    async def _serial_acquire(self, checksum: str) -> bool:
        """True: another node holds the Lease (we wait). Raises KubeError on API trouble."""
        now = self.clock()
        duration = int(self.config.serial_lease_duration.total_seconds())

        problems: tuple[str, ...] = ()

        write = "serial-acquire"

        def change(lease: JSON) -> tuple[bool, tuple[pacing.SerialStep, int | None]]:
            nonlocal problems, write
            joining = self._ticket_for(checksum) is None
            step, ticket, ledger = self._serial_turn(lease, checksum, now)
            read, problems = _parse_ledger(lease)
            self._saw_ledger(read, checksum)
            drawn = ledger != read or bool(problems)
            write = "serial-acquire" if step.action == "acquire" else "join"
            if step.action == "acquire":
                lease["spec"] = dict(step.spec)
            if drawn:
                learned = joining and ticket is not None
                _put_ledger(lease, self._learned(ledger) if learned else ledger)
            return step.action == "acquire" or drawn, (step, ticket)

        try:
            step, ticket = await self._update(
                change, shown=self._live_shown(), contend=True, kind=lambda: write
            )
        except _Contended:
            message = (
                f"serial rollout: waiting in line for Lease {report.NAMESPACE}/{self.lease_name}"
            )
            await self._wait(pacing.REASON_SERIAL, message, checksum, self._contended(checksum))
            return True
        if step.action == "acquire" or ticket is not None:
            self._joined()
        self._keep_ticket(checksum, ticket)
        await self._report_ledger(problems)
        if step.action == "acquire":
            self._set(holders=(self.ctx.host_name,))
            log.info("serial Lease acquired, applying", lease=self.lease_name, checksum=checksum)
            return False
        self._set(holders=(step.holder,) if step.holder else ())
        if step.holder is None:
            message = (
                f"serial rollout: waiting in line for Lease {report.NAMESPACE}/{self.lease_name}"
            )
        else:
            # the holder is in the view, not in the words: the condition of a waiting node is
            # not rewritten for each node the Lease passes to
            message = (
                f"serial rollout: another node holds Lease {report.NAMESPACE}/"
                f"{self.lease_name} (at most {duration}s after its last renewal, unless released)"
            )
        await self._wait(pacing.REASON_SERIAL, message, checksum, step.expires_in)
        return True

    def _serial_turn(
        self, lease: Mapping[str, Any], checksum: str, now: float
    ) -> tuple[pacing.SerialStep, int | None, Ledger]:
        """Gardener's step on the Lease ``spec``, taken only in this node's turn in the line:
        a released Lease wakes the next ticket, not every waiting node. Returns the step (a
        wait when it is not our turn), our ticket, and the ledger to write (a ticket drawn,
        or ours served)."""
        duration = int(self.config.serial_lease_duration.total_seconds())
        spec = lease.get("spec") or {}
        step = pacing.serial_step(spec, self.ctx.host_name, now, duration, self._seen_serial)
        ledger = pacing.for_checksum(_ledger_of(lease), checksum)
        if spec.get("holderIdentity") == self.ctx.host_name:
            return step, None, ledger  # ours already (a retry renews it): no line
        places = 1 if step.action == "acquire" else 0
        key = ("serial", checksum, str(spec.get("holderIdentity")))
        mine = self._ticket_for(ledger.checksum)
        go = pacing.turn(ledger, mine, places, now, self._seen_slots, key, pacing.JOIN_DEPTH)
        if go.now:
            return step, None, pacing.serve(ledger, go.ticket, places)
        if step.action == "acquire":  # free, but others are ahead in line
            step = pacing.SerialStep("wait", holder=None, expires_in=go.retry_in or 0.0)
        return step, go.ticket, go.ledger

    def _ticket_for(self, checksum: str) -> int | None:
        if self._ticket is not None and self._ticket[0] == checksum:
            return self._ticket[1]
        return None

    def _keep_ticket(self, checksum: str, ticket: int | None) -> None:
        self._ticket = None if ticket is None else (checksum, ticket)

    def _contended(self, checksum: str) -> float:
        """A write that lost its race: when to decide again. A node whose turn it was looks
        at the next Lease its watch shows at once; a joining node doubles its window and waits
        a random part of it (and the Lease that won may well have made its write needless).
        In a pool whose size is known the pool's window already spreads the joins as far as
        they need: a lost race is the share of collisions that window leaves, and doubling it
        would put the loser behind the whole pool (it waited out a rollout's length). Its own
        window then doubles from the floor only, which counts once the pool's is narrower (a
        pool that grew since it was counted)."""
        if self._ticket_for(checksum) is not None:
            return 0.0
        own = max(self._window, JOIN_WINDOW) if self._pool_sized else self._join_window()
        self._window = min(own * 2, JOIN_WINDOW_MAX)
        self._join_at = None
        return self._join_delay()

    def _first_join(self, lease: JSON | None, checksum: str) -> bool:
        """This node is about to make the first join of a pool that has never counted itself
        (its first paced rollout): nobody joined yet and no size is known."""
        record = pacing.for_checksum(_ledger_of(lease) if lease else Ledger(), checksum)
        return not record.pool and not record.joined and self._ticket_for(checksum) is None

    async def _count_pool(self) -> None:
        """Count the pool's Nodes for its first paced rollout: the first join writes the count
        into the ledger, and the rest of the pool, which drew its join delays in a window for a
        pool of unknown size, draws them again in one sized by it (``pacing.join_window``).
        Without it the first rollout of a large pool began with its nodes racing (measured at
        100 nodes: 17 of 21 lost writes in its first second). Gardener labels each Node of a
        worker pool with the name of the pool's OSC Secret, the name of this Lease; the list
        is of metadata only, in pages, and made once per agent, by the few nodes whose join
        comes before the first one is seen. An agent that may not list Nodes, or a pool
        without the label, learns its window as before."""
        if self._counted is not None:
            return
        self._counted = 0
        selector = f"{report.LABEL_SECRET_NAME}={self.lease_name}"
        token: str | None = None
        try:
            for _ in range(pacing.MAX_POOL // POOL_PAGE + 1):
                page = await self.ctx.kube.nodes().list(
                    label_selector=selector,
                    limit=POOL_PAGE,
                    continue_token=token,
                    metadata_only=True,
                )
                self._counted += len(page.get("items") or [])
                token = (page.get("metadata") or {}).get("continue") or None
                if token is None or self._counted >= pacing.MAX_POOL:
                    break
        except KubeError as exc:
            log.info("rollout pool not counted", lease=self.lease_name, error=str(exc))
            self._counted = 0
            return
        self._counted = min(self._counted, pacing.MAX_POOL)
        log.info("rollout pool counted", lease=self.lease_name, nodes=self._counted)

    def _saw_ledger(self, ledger: Ledger, checksum: str) -> None:
        """What a ledger says of the pool's joins for ``checksum``: its window (one at the
        floor or below is none, as a learned one is), and how many tickets it drew. A ledger
        still of the checksum before is read as the record it starts (the pool its last
        rollout counted)."""
        now = asyncio.get_running_loop().time()
        if ledger != self._still[0]:
            self._still = (ledger, now)
        record = pacing.for_checksum(ledger, checksum)
        self._sized_by = (checksum, record.pool) if record.pool else None
        sized = self._sized_by is not None and self._sized_by != self._distrusted
        window = pacing.join_window(record) if sized else record.window
        if sized and not self._pool_sized:
            # the pool's size just became known (its first joiner counted it): a join delay
            # drawn in the narrow window of an unknown pool is drawn again in the sized one
            self._join_at = None
        self._pool_sized = sized
        self._pool_window = window if window > JOIN_WINDOW else 0.0
        self._drawn_so_far = ledger.tickets

    def _join_window(self) -> float:
        """The window this node's next join is drawn from: the pool's, or its own when a lost
        race widened it beyond."""
        return min(max(self._window, self._pool_window, JOIN_WINDOW), JOIN_WINDOW_MAX)

    def _learned(self, ledger: Ledger) -> Ledger:
        """``ledger`` with what this node's join says of the pool's window: how long it
        waited after it drew its delay, in which window, and whether it lost a race before
        (``pacing.learn_window``), and counted as one more node joined (``pacing.count_join``)."""
        ledger = pacing.count_join(ledger, counted=self._counted or 0)
        if self._join_drawn is None or self._pool_sized:
            return ledger  # (a pool of known size has its window from that, not learned)
        drawn_at, window, drawn_so_far, pool = self._join_drawn
        # the joins that landed since the draw came first (ours is the k-th): each of the k
        # took about waited / k of the window
        k = min(max(ledger.tickets - drawn_so_far, 1), pacing.MAX_LEDGER_ENTRIES)
        waited = (asyncio.get_running_loop().time() - drawn_at) / k
        if self._window > JOIN_WINDOW:  # it lost a race since: its own window was backed off
            return pacing.learn_window(ledger, pool, waited, JOIN_WINDOW, lost=True)
        return pacing.learn_window(ledger, window, waited, JOIN_WINDOW)

    def _join_delay(self, cap: float | None = None) -> float:
        """Seconds until this node's join is due: drawn once from its window (at most
        ``cap`` wide) when it first sees a join to make, and kept while the line has room, so
        the watch events and wake-ups that keep coming neither draw again (their minimum would
        shrink it) nor write early; drawn afresh once the line was seen full."""
        now = asyncio.get_running_loop().time()
        if self._join_at is None:
            window = self._join_window()
            capped = cap is not None and cap < window
            width = window if cap is None else min(window, cap)
            self._join_at = now + self._rng.uniform(0.0, width)
            # a draw cut short by the cap says nothing of the pool's window: not learned from
            pool = max(self._pool_window, JOIN_WINDOW)
            if self._window > JOIN_WINDOW and self._join_drawn is not None:
                pool = self._join_drawn[3]  # a redraw after a lost race: the pool's at the first
            self._join_drawn = None if capped else (now, window, self._drawn_so_far, pool)
            self._drew_at = now
        elif self._pool_sized and now - max(self._drew_at, self._still[1]) >= pacing.TICKET_GRACE:
            # A size is written by any node of the pool: one that leaves this node waiting to
            # join, with nothing changing on the Lease, for a grace is not believed for the rest
            # of this checksum (a forged pool of 5000 in a pool of 10 would space the joins up
            # to an hour apart). The join is drawn again in the learned window.
            log.info("rollout pool size not believed", pool=self._sized_by)
            self._distrusted, self._pool_sized = self._sized_by, False
            self._pool_window = self._still[0].window if self._still[0] is not None else 0.0
            self._join_at = None
            return self._join_delay(cap)
        return max(0.0, self._join_at - now)

    def _joined(self) -> None:
        """A write of this node's landed: its next join is drawn afresh, in the pool's window."""
        self._window = JOIN_WINDOW
        self._join_at = self._join_drawn = None

    async def _serial_release(self) -> None:
        def change(lease: JSON) -> tuple[bool, None]:
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.ctx.host_name:
                return False, None
            lease["spec"] = pacing.serial_released(spec)
            return True, None

        try:
            await self._update(
                change,
                create=False,
                shown=self._live_shown(),
                must_land=True,
                kind=lambda: "serial-release",
            )
            log.info("serial Lease released", lease=self.lease_name)
        except KubeNotFound:
            pass

    # -- slots -----------------------------------------------------------------------------------

    def _decide(
        self, policy: pacing.Pacing, ledger: Ledger, checksum: str, *, serial: bool
    ) -> Decision:
        """The pure decision, with this node's memory (sightings, ticket). Under the serial
        Lease there is no line for slots (the Lease orders the nodes)."""
        return pacing.decide(
            policy,
            ledger,
            self.ctx.host_name,
            checksum,
            self.clock(),
            self._seen_slots,
            ticket=self._ticket_for(checksum),
            line=not serial,
        )

    async def _take_slot(self, policy: pacing.Pacing, checksum: str, *, serial: bool) -> Decision:

        problems: tuple[str, ...] = ()
        write = "take"

        def change(lease: JSON) -> tuple[bool, Decision]:
            nonlocal problems, write
            joining = self._ticket_for(checksum) is None
            ledger, problems = _parse_ledger(lease)
            self._saw_ledger(ledger, checksum)
            decision = self._decide(policy, ledger, checksum, serial=serial)
            joins = decision.ledger != ledger and joining
            if joining and not joins:
                self._join_at = None  # no join to make: the next one is drawn afresh
            elif joins and not serial and (due := self._join_delay()) > TIMER_SLACK:
                # not yet this node's time (a wake-up before its join was due): no write; under
                # the serial Lease there is no race to spread (its holder is the one writer).
                # A ledger it would repair is reported by the node that writes the repair.
                problems = ()
                return False, _waiting_to_join(policy, ledger, checksum, due)
            changed = decision.ledger != ledger or bool(problems)
            write = "take" if decision.action == "proceed" else "join" if changed else "repair"
            if changed:
                _put_ledger(lease, self._learned(decision.ledger) if joins else decision.ledger)
            return changed, decision

        shown = self._live_shown()
        self._joining = True
        try:
            if self._looked_for != checksum and not serial and self._ticket_for(checksum) is None:
                self._looked_for = checksum
                shown = await self._look_before_joining(policy, checksum, shown)
            if not serial and self._first_join(shown, checksum):
                await self._count_pool()
            decision = await self._update(change, shown=shown, contend=True, kind=lambda: write)
        except (_Contended, _Deferred) as stopped:
            retry_in = (
                self._contended(checksum) if isinstance(stopped, _Contended) else self._join_delay()
            )
            wait = _waiting_to_join(policy, Ledger(), checksum, retry_in)
            return replace(wait, ticket=self._ticket_for(checksum))
        finally:
            self._joining = False
        if decision.action == "proceed" or decision.ticket is not None:
            self._joined()
        self._keep_ticket(decision.ledger.checksum, decision.ticket)
        await self._report_ledger(problems)
        ledger = decision.ledger
        self._set(
            holders=ledger.holders(),
            canaries=ledger.canaries,
            failures=len(ledger.failed),
            breaker_open=ledger.breaker_open(policy),
        )
        return decision

    async def _look_before_joining(
        self, policy: pacing.Pacing, checksum: str, shown: JSON | None
    ) -> JSON | None:
        """A node's first look at the pool's Lease for an update. The whole pool looks in the
        same second when the Secret changes: if every node that finds a place to take, a ticket
        to draw or no Lease at all wrote at once, all but one write would lose (N - 1 conflicts
        and as many reads, the Lease's first creation the same). So a node whose decision would
        be such a join first waits a random delay in its join window (never longer than its
        recheck), watching the Lease from the version it read, and then decides on what the
        watch shows: the first nodes fill the free places and the line, the others stand down
        without writing. A node already watching (it waited for the update before this one)
        looks at the Lease its watch shows, without a read. Returns the Lease to decide on
        (None: none seen; read it again)."""
        lease = shown if shown is not None else await self._read()
        if lease is not None:
            ledger = _ledger_of(lease)
            self._saw_ledger(ledger, checksum)
            if self._decide(policy, ledger, checksum, serial=False).ledger == ledger:
                return lease  # nothing to write (it waits, or its place is already taken)
        self._watch_while_waiting()
        recheck = self.config.recheck_max.total_seconds()
        # within the node's recheck, as a first look always was, unless the pool learned a
        # wider window: then a join due later waits, watching, and the loop is not held
        self._join_at = None
        delay = self._join_delay(cap=recheck if self._pool_window <= recheck else None)
        if delay > recheck:
            raise _Deferred()
        await asyncio.sleep(delay)
        return self._live_shown() or lease

    async def _read(self, *, missing_ok: bool = True) -> JSON | None:
        """Read the Lease and note it as this node's last look; None when it does not exist
        (KubeNotFound unless ``missing_ok``)."""
        self._looked_at = asyncio.get_running_loop().time()
        try:
            lease = await self.ctx.kube.get_lease(report.NAMESPACE, self.lease_name)
        except KubeNotFound:
            self._decided_on = self._known = None
            if not missing_ok:
                raise
            return None
        self._decided_on = _resource_version(lease)
        self._saw(lease)
        return lease

    async def _readopt(self, checksum: str, ttl: float) -> pacing.Slot | None:
        host = self.ctx.host_name

        def change(lease: JSON) -> tuple[bool, pacing.Slot | None]:
            renewed = pacing.renew(_ledger_of(lease), host, checksum, self.clock(), ttl)
            if renewed is None:
                return False, None
            _put_ledger(lease, renewed)
            return True, renewed.slot_of(host)

        try:
            return await self._update(change, create=False, kind=lambda: "readopt")
        except KubeNotFound:
            return None

    async def _finish(
        self, checksum: str, policy: pacing.Pacing | None, *, ok: bool, why: str
    ) -> None:
        """The slot freed, the result recorded, and the place handed to the next ticket in
        the same write (``pacing.hand_over``)."""
        host = self.ctx.host_name
        receiver: str | None = None

        def change(lease: JSON) -> tuple[bool, Ledger]:
            nonlocal receiver
            ledger = _ledger_of(lease)
            now = self.clock()
            done = pacing.finish(ledger, host, checksum, now, ok=ok, why=why[:300])
            if policy is not None:
                left = done
                done = pacing.hand_over(policy, left, checksum, now, self._seen_slots)
                receiver = next((h for h in done.holders() if h not in left.holders()), None)
            changed = done != ledger
            if changed:
                _put_ledger(lease, done)
            return changed, done

        try:
            ledger = await self._update(
                change,
                create=False,
                shown=self._live_shown(),
                must_land=True,
                kind=lambda: "result",
            )
        except KubeNotFound:
            return
        except KubeError as exc:
            # the slot expires by itself; a failure we could not record counts as lost then
            log.warning("rollout result not recorded; the slot will expire", error=str(exc))
            return
        self._set(holders=ledger.holders(), failures=len(ledger.failed))
        log.info("rollout slot released", checksum=checksum, ok=ok, handed_to=receiver)

    async def _leave(self, checksum: str) -> None:
        """Free this node's slot of ``checksum`` (superseded), a write that must land; an API
        error leaves it to expire, as before."""
        host = self.ctx.host_name

        def change(lease: JSON) -> tuple[bool, None]:
            ledger = _ledger_of(lease)
            if ledger.slot_of(host) is None:
                return False, None
            _put_ledger(lease, pacing.leave(ledger, host))
            return True, None

        try:
            await self._update(change, create=False, must_land=True, kind=lambda: "result")
        except KubeNotFound:
            return
        except KubeError as exc:
            log.warning("superseded rollout slot not freed; it will expire", error=str(exc))
            return
        log.info("rollout slot freed: its update was superseded", checksum=checksum)

    async def _report_ledger(self, problems: tuple[str, ...]) -> None:
        """A ledger that had to be repaired (garbage, numbers out of range): a Warning, once
        per distinct finding, naming the Lease and what was wrong."""
        if not problems or problems == self._ledger_problems:
            return
        self._ledger_problems = problems
        message = (
            f"rollout ledger on Lease {report.NAMESPACE}/{self.lease_name} repaired: "
            f"{'; '.join(problems)}"
        )[:1024]
        log.warning("rollout ledger repaired", lease=self.lease_name, problems=problems)
        await self.ctx.event(report.REASON_ROLLOUT_LEDGER_REPAIRED, message, warning=True)

    def _start_renewer(
        self, checksum: str, ttl: float, *, claim: bool = False
    ) -> asyncio.Task[None]:
        # The renewer lives no longer than the loop that took the slot: a killed agent's slot
        # must expire. A handed slot is claimed (renewed with the pool's ttl) sooner.
        first = min(pacing.CLAIM_AFTER, ttl / 3) if claim else None
        return _bound(self._renew(checksum, ttl, first), "rollout-slot-renewer")

    def _watch_while_waiting(self) -> None:
        """Watch the Lease while this node waits: a released Lease, a freed slot, a canary's
        result or a reset ledger wakes the loop soon (Gardener's agent watches its serial Lease
        for releases the same way); the jittered re-check stays as the fallback. The watch
        starts from the Lease this node's decision just read or wrote (no list: the version is
        known, and shown at once)."""
        if self._watcher is None or self._watcher.done():
            known, start = self._known, None
            if known is not None and _resource_version(known) == self._decided_on:
                start = self._decided_on
                self._shown, self._watched = _copy(known), start
            self._watcher = _bound(self._watch_lease(start), "rollout-lease-watch")

    def _stop_watch(self) -> None:
        watcher, self._watcher = self._watcher, None
        self._shown = None
        if watcher is not None:
            watcher.cancel()

    def _live_shown(self) -> JSON | None:
        """The Lease as the running watch last showed it (or as this node last read or wrote
        it since); None when no watch runs."""
        if self._watcher is None or self._watcher.done():
            self._shown = None
        return self._shown

    def _saw(self, lease: JSON) -> None:
        """A version of the Lease this node read or wrote."""
        self._known = lease
        if self._live_shown() is not None:
            self._shown = _copy(lease)

    async def _watch_lease(self, start: str | None) -> None:
        events = list_watch(
            self.ctx.kube.leases(report.NAMESPACE),
            field_selector=f"metadata.name={self.lease_name}",
            resource_version=start,
            registry=self.ctx.watches,
        )
        async with events:
            async for event in events:
                if self._view.state not in ("waiting", "applying") and not self._joining:
                    return
                shown = event.object if event.type != "DELETED" else None
                self._shown = _copy(shown) if shown is not None else None
                self._watched = _resource_version(shown)
                if (
                    self._view.state == "waiting"
                    and not self._joining
                    and self._changed_since_decision()
                ):
                    self._judge_shown()

    def _judge_shown(self) -> None:
        """A change of the Lease while this node waits: wake the loop only when this node is
        the one to act on it (its turn in the line, a Lease to take, a report to change, a
        ticket to draw), else set the timer to when time alone may make it so. Every other
        waiting node of the pool stays asleep: a freed slot costs one node's requests, not
        the pool's."""
        if self._shown is None or self._waiting_for is None:
            self._schedule_sooner(self._rng.uniform(0.0, WATCH_SPREAD))
            return
        policy, checksum = self._waiting_for
        lease, now = self._shown, self.clock()
        self._saw_ledger(_ledger_of(lease), checksum)
        act, retry_in, reason = False, None, None
        mine = self._ticket_for(checksum)
        if policy.serial:
            step, ticket, ledger = self._serial_turn(lease, checksum, now)
            act = step.action == "acquire" or ticket != self._ticket_for(ledger.checksum)
            retry_in, reason = step.expires_in, pacing.REASON_SERIAL
        if policy.pacing is not None and not act and not policy.serial:
            decision = self._decide(policy.pacing, _ledger_of(lease), checksum, serial=False)
            act = decision.action == "proceed" or decision.ticket != self._ticket_for(
                decision.ledger.checksum
            )
            retry_in, reason = decision.retry_in, decision.reason
        if act and mine is None:
            # a join (a ticket to draw, a free place to take without one): the pool sees the
            # same Lease at once, so each node writes after its own random delay
            self._schedule_sooner(self._join_delay())
            return
        if mine is None:
            self._join_at = None  # the line is full: the next join is drawn afresh
        if act or reason != self._view.reason:
            self._schedule_sooner(0.0)
        elif retry_in is not None:
            self._schedule_sooner(max(retry_in, 0.0) + self._rng.uniform(0.05, 0.5))

    def _changed_since_decision(self) -> bool:
        """The watch has shown a Lease other than the one the last decision read or wrote
        (also a change that came while deciding, or before the watch started)."""
        return self._watched != self._decided_on

    async def _renew(self, checksum: str, ttl: float, first: float | None = None) -> None:
        host = self.ctx.host_name
        while True:
            await asyncio.sleep(max(0.2, ttl / 3) if first is None else first)
            first = None

            def change(lease: JSON) -> tuple[bool, bool]:
                renewed = pacing.renew(_ledger_of(lease), host, checksum, self.clock(), ttl)
                if renewed is None:
                    return False, False
                _put_ledger(lease, renewed)
                return True, True

            try:
                held = await self._update(
                    change,
                    create=False,
                    shown=self._live_shown(),
                    must_land=True,
                    kind=lambda: "renew",
                )
            except KubeError as exc:
                log.warning("rollout slot not renewed", error=str(exc))
                continue
            if not held:
                log.warning("rollout slot lost (expired and freed meanwhile)", checksum=checksum)
                return

    async def _stop_renewer(self, permit: Permit) -> None:
        task, permit.renewer = permit.renewer, None
        await cancel_and_wait(task)

    async def _drop_permit(self, *, superseded_by: str | None = None) -> None:
        """A permit left over from a reconcile that ended by an error we were not told about:
        stop renewing its slot (it expires; the breaker counts it as lost). A permit for an
        older checksum than ``superseded_by`` (a newer OSC came while its update was being
        applied or settled: the controller ends the settle window and goes on with the new
        one) frees its slot at once, without a result: left to expire, it kept one of the new
        rollout's K places for the slot's ttl, and with K = 1 the node then waited for its own
        stale slot (measured: K = 5 after K = 10 at 100 nodes ran on 3 places for 30 s)."""
        permit, self._permit = self._permit, None
        if permit is None:
            return
        await self._stop_renewer(permit)
        if self._view.state == "applying":
            self._stop_watch()  # kept for the result this node no longer writes
        if permit.slot and superseded_by is not None and superseded_by != permit.checksum:
            await self._leave(permit.checksum)

    # -- the Lease -------------------------------------------------------------------------------

    def _new_lease(self) -> JSON:
        meta: JSON = {"name": self.lease_name, "namespace": report.NAMESPACE}
        owner = self._owner.get("metadata") or {}
        if owner.get("uid"):
            # as Gardener's agent creates it: owned by the Secret (collected with it)
            meta["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "name": owner.get("name") or self.lease_name,
                    "uid": owner["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {},
        }

    async def _update(
        self,
        change: Callable[[JSON], tuple[bool, T]],
        *,
        create: bool = True,
        shown: JSON | None = None,
        contend: bool = False,
        must_land: bool = False,
        kind: Callable[[], str],
    ) -> T:
        """Read the Lease, let ``change`` edit it, write it back with compare-and-swap (the read
        resourceVersion); on a conflict read again and decide again. ``shown``: the Lease as
        the watch last showed it, used instead of the first read (a waiting node that decides
        to wait again costs no request at all). ``contend``: a conflict raises
        :class:`_Contended` instead (the caller waits for the watch to show the winner).
        ``must_land``: a write this node owes the pool (a slot's renewal or result, the serial
        Lease's release): the shown Lease is used only for a write, which the compare-and-swap
        checks; "nothing to write" is believed only from a fresh read (the watch may deliver a
        version older than this node's own last write, without its slot). ``kind``: what the
        write is for, as ``change`` last decided (a lost race is counted by it)."""
        kube = self.ctx.kube
        backoff = Backoff.of(retry.CONFLICT, rng=self._rng)
        if shown is not None and _resource_version(shown) == self._lost_on:
            shown = None  # the watch has not shown the winner yet: read it
        for attempt in range(CAS_ATTEMPTS):
            if attempt == 0 and shown is not None:
                lease, exists = shown, True
                self._decided_on = _resource_version(lease)
                body = _copy(lease)
                write, result = change(body)
                if not write and not must_land:
                    return result
                if write:
                    try:
                        written = await kube.update_lease(report.NAMESPACE, self.lease_name, body)
                        self._decided_on = _resource_version(written)
                        self._saw(written)
                        return result
                    except KubeConflict:  # another node wrote first (or the watch was behind)
                        self._lost(kind())
                        if contend:
                            self._lost_on = self._decided_on
                            raise _Contended() from None
                continue
            read = await self._read(missing_ok=create)
            lease, exists = (read, True) if read is not None else (self._new_lease(), False)
            body = _copy(lease)
            write, result = change(body)
            if not write:
                return result
            try:
                if exists:
                    written = await kube.update_lease(report.NAMESPACE, self.lease_name, body)
                else:
                    written = await kube.create_lease(report.NAMESPACE, body)
                self._decided_on = _resource_version(written)
                self._saw(written)
                return result
            except KubeConflict:  # also AlreadyExists: someone else wrote first
                self._lost(kind())
                if contend:
                    self._lost_on = self._decided_on
                    raise _Contended() from None
                if attempt + 1 == CAS_ATTEMPTS:
                    raise
                await backoff.wait()
        raise AssertionError("unreachable")

    def _lost(self, kind: str) -> None:
        """A compare-and-swap write lost its race: counted by what it was for (the metric) and
        logged with the moment, so a rollout's lost writes can be placed on its timeline."""
        self._conflicts[kind] += 1
        log.info("rollout Lease write lost", write=kind)

    # -- reporting -------------------------------------------------------------------------------

    async def _wait(self, reason: str, message: str, checksum: str, retry_in: float | None) -> None:
        low = self.config.recheck_min.total_seconds()
        high = max(low, self.config.recheck_max.total_seconds())
        delay = self._rng.uniform(low, high)
        if retry_in is not None:
            delay = min(delay, max(retry_in, 0.0) + self._rng.uniform(0.05, 0.5))
        # a change the watch showed while this node decided is judged as soon as it waits
        changed = (
            self._watcher is not None
            and not self._watcher.done()
            and self._changed_since_decision()
        )
        self._schedule(delay)
        self._watch_while_waiting()
        if changed:
            self._judge_shown()
        first = self._view.state != "waiting" or self._view.reason != reason
        self._set(
            state="waiting",
            reason=reason,
            message=message,
            since=self.clock() if first else self._view.since,
            waits=self._view.waits + 1,
            canary=False,
        )
        if self._announced != (reason, checksum):
            self._announced = (reason, checksum)
            log.info(
                "OSC update waits for the rollout",
                reason=reason,
                detail=message,
                recheck=round(delay, 1),
            )
            if reason == pacing.REASON_BREAKER:
                # an Event only for what needs a person: waiting in line is the condition's
                # (an Event per node and state made a rollout cost each node two more writes)
                await self.ctx.event(reason, message, warning=True)
        await self._condition("False", reason, message)

    async def _proceed(
        self, checksum: str, message: str, *, canary: bool, writes_again: bool
    ) -> None:
        """Going ahead. A node that holds a slot or the serial Lease writes the Lease again
        when it is done: the watch it waited with stays open until then, so that write goes on
        the Lease the watch shows, without a read."""
        if not writes_again:
            self._stop_watch()
        if self._view.state == "waiting":
            self._announced = None
        self._set(
            state="applying",
            reason=report.REASON_ROLLOUT_APPLYING,
            message=message,
            since=self.clock(),
            canary=canary,
        )
        await self._condition("True", report.REASON_ROLLOUT_APPLYING, message)

    def _schedule(self, delay: float) -> None:
        """Wake the loop after ``delay``, but never sooner than :data:`MIN_RECHECK` after the
        last look at the Lease (a NaN or negative delay counts as that)."""
        self._stop_timer()
        loop = asyncio.get_running_loop()
        least = max(min(MIN_RECHECK, self.config.recheck_min.total_seconds()), RECHECK_FLOOR)
        floor = self._looked_at + least - loop.time()
        delay = delay if math.isfinite(delay) else floor
        self._timer = loop.call_later(max(delay, floor, 0.0), self._fire)

    def _fire(self) -> None:
        # a timer that fired is no longer one to keep: a later "sooner" must set a new one
        # (it compared with the fired one's time and set none: the node missed its turn)
        self._timer = None
        self._wake()

    def _schedule_sooner(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        if self._timer is None or self._timer.when() > loop.time() + delay:
            self._schedule(delay)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _set(self, **changes: Any) -> None:
        self._view = replace(self._view, **changes)

    def node_seen(self, node: Mapping[str, Any]) -> None:
        """A version of the Node from the Node controller's watch: our condition as the Node
        carries it, so that the first write after a restart keeps its ``lastTransitionTime``
        (the writes themselves need no read of the Node). Once this agent wrote it, its own
        record wins (the watch may still show an older version)."""
        if self._reported is not None:
            return
        conditions = (node.get("status") or {}).get("conditions") or []
        ours = next(
            (
                c
                for c in conditions
                if isinstance(c, dict) and c.get("type") == report.CONDITION_ROLLOUT
            ),
            None,
        )
        if ours is not None:
            self._on_node = (str(ours.get("status")), str(ours.get("lastTransitionTime") or ""))

    async def _condition(self, status: str, reason: str, message: str) -> None:
        """The ``OSCRollout`` condition on the Node, written only when it changes: one
        strategic-merge patch (merged by ``type``; no GET of the Node, no compare-and-swap, no
        conflict with the other writers of the Node's conditions). A failed write is logged
        (it is a report, never a reason to stop)."""
        name = self.ctx.node_name
        wanted = (status, reason, message)
        if name is None or self._reported == wanted:
            return
        same = self._reported is not None and self._reported[:2] == wanted[:2]
        if same and time.monotonic() - self._reported_at < MESSAGE_REFRESH:
            return  # only the message changed, and it was written less than a minute ago
        at = report.rfc3339(report.now())
        before, since = self._on_node or ("", "")
        entry = {
            "type": report.CONDITION_ROLLOUT,
            "status": status,
            "reason": reason,
            "message": message[:1024],
            "lastHeartbeatTime": at,
            "lastTransitionTime": since if before == status and since else at,
        }
        try:
            await self.ctx.kube.patch_node_condition(name, entry)
        except KubeError as exc:
            log.warning("rollout condition not written", error=str(exc))
            return
        self._reported, self._reported_at = wanted, time.monotonic()
        self._on_node = (status, entry["lastTransitionTime"])


def _handing(permit: Permit) -> pacing.Pacing | None:
    """The policy under which the node leaving its slot hands it on; None under the serial
    Lease (its holder is the one writer: the next node takes the Lease first, then its slot)."""
    return None if permit.serial else permit.pacing


def _copy(obj: Mapping[str, Any]) -> JSON:
    out = dict(obj)
    out["metadata"] = dict(obj.get("metadata") or {})
    out["metadata"]["annotations"] = dict(out["metadata"].get("annotations") or {})
    out["spec"] = dict(obj.get("spec") or {})
    return out


def _ledger_of(lease: Mapping[str, Any]) -> Ledger:
    return _parse_ledger(lease)[0]


def _waiting_to_join(
    policy: pacing.Pacing, ledger: Ledger, checksum: str, retry_in: float
) -> Decision:
    """The decision of a node whose join is not due yet (or lost its race): it waits in line."""
    message = (
        f"waiting in line for one of {policy.max_parallel} rollout slot(s) of OSC {checksum[:12]}"
    )
    return Decision(
        "wait",
        pacing.for_checksum(ledger, checksum),
        pacing.REASON_SLOT,
        message,
        retry_in=retry_in,
    )


def _parse_ledger(lease: Mapping[str, Any]) -> tuple[Ledger, tuple[str, ...]]:
    annotations = (lease.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(pacing.ANNOTATION_LEDGER)
    return Ledger.parse(raw if isinstance(raw, str) else None)


def _put_ledger(lease: JSON, ledger: Ledger) -> None:
    lease["metadata"]["annotations"][pacing.ANNOTATION_LEDGER] = ledger.dump()


def _bound(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
    """A task that ends with the task creating it (the reconcile loop): cancelling the agent
    never leaves it behind renewing a slot or watching."""
    task = asyncio.create_task(coro, name=name)
    owner = asyncio.current_task()
    if owner is not None:

        def cancel(_owner: asyncio.Task[Any]) -> None:
            task.cancel()

        owner.add_done_callback(cancel)
        task.add_done_callback(lambda _t: owner.remove_done_callback(cancel))
    return task


def _resource_version(obj: Mapping[str, Any] | None) -> str | None:
    if not obj:
        return None
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return str(value) if value else None
