"""The ``crash`` scenario of ``bench.fleet``: a paced rollout loses a holder and a waiting node.

A paced rollout promises that a node dying costs the pool a bounded wait, whatever it held:

- a **holder** killed while it applies (SIGKILL; its agent is not restarted): nobody hands its
  place on, so the place comes back when its slot expires (the slot ttl every node trusts;
  ``--crash-ttl``, set on the Secret), and the breaker counts the holder as lost. Printed: the
  time from the kill until another node's write dropped the slot and took its place (the
  successor's wait), beside when the slot expired by the ledger;
- the node holding the **first ticket** in line, killed while it waits: the next holder that
  leaves hands it its place in its result write; the dead node never claims it, and the place
  comes back ``HANDOFF_TTL`` after the handoff, not counted as a failure. Printed: the time
  from the handoff until another node's write dropped it, and the breaker's count.

K is 2, so that the pool still waits when each place comes back (one place lost to the dead
holder, the other handed to the dead node). Both agents are then started again (as their
unit's ``Restart=always`` would, much later) and the rollout must converge on every node. The
breaker is set to ``K`` failures so that the lost holder (one failure) does not hold the pool.

    .venv/bin/python -m bench.fleet --agents 20 --scenarios crash [--crash-ttl 60]
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kubernetes_asyncio.client.exceptions import ApiException

from bench.fleet import Fleet, Member, fleet_osc, pacing_annotations, pool_ledger, publish
from node_agent.controllers.osc import pacing

#: two places: one lost with its dead holder, one handed on to the dead first ticket, and the
#: pool still waiting when each comes back (a larger K finishes a small pool meanwhile)
K = 2
POLL = 0.1


@dataclass
class Victim:
    member: Member
    #: loop time of the kill, of the handoff to it (first ticket), of the write that dropped its
    #: slot (another node's, once the slot had expired)
    killed: float = 0.0
    handed: float | None = None
    gone: float | None = None
    #: the holder's slot: when it was last renewed, by the bench's clock (the ledger's time)
    renewed: float = 0.0


async def ledger_now(fleet: Fleet) -> pacing.Ledger:
    try:
        return await pool_ledger(fleet.admin, fleet.secret)
    except ApiException:
        return pacing.Ledger()


async def kill(member: Member) -> None:
    """SIGKILL, and kept dead: the supervisor restarts only an agent it still holds."""
    proc, member.proc = member.proc, None
    assert proc is not None
    proc.kill()
    await proc.wait()


async def crash(fleet: Fleet, ttl: float) -> None:
    assert fleet.watcher is not None
    label = "crash"
    tag = fleet.next_tag()
    annotations = {
        **pacing_annotations(K, breaker=K),
        pacing.ANNOTATION_SLOT_TTL: f"{ttl:g}s",
    }
    print(f"{label}: publishing {tag} {annotations}", flush=True)
    by_name = {m.name: m for m in fleet.members}
    t0 = time.time()
    checksum = await publish(fleet.admin, fleet.secret, fleet_osc(tag), annotations)
    fleet.kubelet_tag = tag
    holder = waiter = None
    deadline = time.monotonic() + fleet.args.timeout
    while holder is None and time.monotonic() < deadline:
        await asyncio.sleep(POLL)
        ledger = await ledger_now(fleet)
        head = ledger.head()
        taken = [s for s in ledger.slots if s.checksum == checksum and not s.handed]
        if ledger.checksum == checksum and taken and head is not None and head in ledger.hosts:
            slot = taken[0]
            holder = Victim(by_name[slot.host], renewed=slot.renewed)
            waiter = Victim(by_name[ledger.hosts[head]])
    if holder is None or waiter is None:
        fleet.row(f"{label}: a holder and a first ticket to kill", "NOT SEEN")
        return
    for victim in (holder, waiter):
        await kill(victim.member)
        victim.killed = time.monotonic()
    killed_at = time.time()
    print(f"  killed holder {holder.member.name}, first ticket {waiter.member.name}", flush=True)
    rest = [n for n in fleet.names if n not in (holder.member.name, waiter.member.name)]
    failed: dict[str, str] = {}
    # until another node's write dropped both slots (each once expired), or the rest converged
    while holder.gone is None or waiter.gone is None:
        if time.monotonic() > deadline or fleet.watcher.count(rest, checksum) == len(rest):
            break
        await asyncio.sleep(POLL)
        ledger = await ledger_now(fleet)
        now = time.monotonic()
        failed = dict(ledger.failed)
        mine = ledger.slot_of(waiter.member.name)
        if waiter.handed is None and mine is not None and mine.handed:
            waiter.handed = now
        if waiter.handed is not None and waiter.gone is None and mine is None:
            waiter.gone = now
        if holder.gone is None and ledger.slot_of(holder.member.name) is None:
            holder.gone = now
    for victim in (holder, waiter):
        await fleet.spawn(victim.member)
    done = await fleet.watcher.wait_all(fleet.names, checksum, fleet.args.timeout, progress=label)
    elapsed = time.time() - t0

    def since(at: float | None, start: float) -> str:
        return "never" if at is None else f"{at - start:.1f} s"

    expiry = holder.renewed + ttl - killed_at  # by the ledger: when its slot expired
    fleet.row(
        f"{label}: holder killed -> its place taken by the next",
        since(holder.gone, holder.killed),
        f"its slot expired {expiry:.1f} s after the kill (ttl {ttl:g} s, renewed "
        f"{killed_at - holder.renewed:.1f} s before the kill); counted as lost: "
        f"{holder.member.name in failed}",
    )
    fleet.row(
        f"{label}: first ticket killed -> handed a place",
        since(waiter.handed, waiter.killed),
        "by the next holder that left",
    )
    fleet.row(
        f"{label}: handed to the dead node -> its place taken by the next",
        since(waiter.gone, waiter.handed or 0.0),
        f"HANDOFF_TTL {pacing.HANDOFF_TTL:g} s; counted as failed: {waiter.member.name in failed}",
    )
    fleet.row(
        f"{label}: Secret update -> all nodes converged",
        f"{elapsed:.1f} s" + ("" if done else " NOT CONVERGED"),
        "both agents started again once measured",
    )
    fleet.figures[label] = {
        "successor_wait_s": None if holder.gone is None else holder.gone - holder.killed,
        "slot_expired_s": expiry,
        "handed_taken_s": None
        if waiter.gone is None or waiter.handed is None
        else waiter.gone - waiter.handed,
        "ttl_s": ttl,
        "converged": done,
        "wall_s": elapsed,
    }
