"""The idle agent's load on the API server, counted by the server itself (its audit log).

The whole agent (``run_agent``, default settings: the systemd unit check every 1m, the OSC
resync, the Lease, the Node and Secret watches) runs against the test bed's kube-apiserver and a
throwaway node with a small OSC applied, the SystemdUnitsReady condition reported; then it is
left idle for --minutes. kube-apiserver writes an audit event per request; the events of the
agent's identity received within the idle window are counted by verb and resource.

Prints requests per minute (total and per verb/resource), the watches open at the end and for
how long each watch lasts, next to upstream gardener-node-agent's 9.5 requests/min measured on
the same test bed.

Run as root from the repository root:  .venv/bin/python -m bench.api_load [--minutes 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import api_client_from, cache_dir
from tests.testbed.agent_harness import (
    create_node,
    inline_file,
    osc_document,
    prepare_agent,
    publish_osc,
    running_agent,
    service,
    wait_applied,
    wait_for,
)
from tests.testbed.controlplane import ControlPlane
from tests.testbed.credentials import node_agent_credentials
from tests.testbed.node_status import units_ready
from tests.testbed.systemd_ns import IsolatedSystemd

UPSTREAM_PER_MINUTE = 9.5
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
"""


def small_osc() -> dict[str, Any]:
    files = [inline_file(f"/etc/node-agent-bench/file-{i}.conf", f"value={i}\n") for i in range(5)]
    units = [service(f"bench-idle-{i}.service") for i in range(4)]
    units.append(service("bench-once.service", "/bin/true", extra="Type=oneshot\n"))
    return osc_document(files, units)


def parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def resource_of(event: dict[str, Any]) -> str:
    ref = event.get("objectRef") or {}
    name = ref.get("resource") or event.get("requestURI", "?").split("?")[0]
    if ref.get("subresource"):
        name += "/" + ref["subresource"]
    return str(name)


def read_audit(path: Path, user: str) -> dict[str, list[dict[str, Any]]]:
    """The agent's audit events by audit ID (a watch has ResponseStarted and later
    ResponseComplete)."""
    events: dict[str, list[dict[str, Any]]] = {}
    with path.open() as lines:
        for line in lines:
            event = json.loads(line)
            if (event.get("user") or {}).get("username") != user:
                continue
            events.setdefault(event["auditID"], []).append(event)
    return events


def report(
    events: dict[str, list[dict[str, Any]]], start: float, end: float, minutes: float
) -> None:
    counts: Counter[tuple[str, str]] = Counter()
    watches_open: Counter[str] = Counter()
    watch_lengths: list[float] = []
    codes: Counter[int] = Counter()
    for stages in events.values():
        first = stages[0]
        received = parse_time(first["requestReceivedTimestamp"])
        done = [e for e in stages if e["stage"] == "ResponseComplete"]
        if first["verb"] == "watch" and received < end:
            ended = parse_time(done[0]["stageTimestamp"]) if done else None
            if ended is None or ended > end:
                watches_open[resource_of(first)] += 1
            elif ended >= start:
                watch_lengths.append(ended - received)
        if not start <= received < end:
            continue
        counts[(first["verb"], resource_of(first))] += 1
        if done:
            codes[int((done[0].get("responseStatus") or {}).get("code", 0))] += 1
    total = sum(counts.values())
    rate = total / minutes
    print(f"idle window: {minutes:.2f} min, {total} requests by the agent's identity")
    print(f"  requests/min: {rate:.2f}   (upstream gardener-node-agent: {UPSTREAM_PER_MINUTE}/min)")
    verdict = "not above" if rate <= UPSTREAM_PER_MINUTE else "ABOVE"
    print(f"  {verdict} upstream's rate ({rate / UPSTREAM_PER_MINUTE:.0%} of it)")
    for (verb, resource), count in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"    {verb:>6} {resource:<28} {count:4d}  {count / minutes:6.2f}/min")
    print(f"  response codes: {dict(sorted(codes.items()))}")
    print(f"  watches open at the end: {sum(watches_open.values())} {dict(watches_open)}")
    if watch_lengths:
        print(
            f"  watches that ended in the window: {len(watch_lengths)}, lasting "
            f"{min(watch_lengths):.0f}-{max(watch_lengths):.0f} s"
        )


async def main(args: argparse.Namespace) -> None:
    work = cache_dir() / "bench" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    audit_log = work / "audit.log"
    policy = work / "audit-policy.yaml"
    policy.write_text(AUDIT_POLICY)
    cp = ControlPlane(work / "cp")
    cp.apiserver.argv += [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={audit_log}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",
    ]
    cp.start()
    node = IsolatedSystemd(work / "nodes", overlay=True)
    node.start()
    name = f"node-{uuid.uuid4().hex[:6]}"
    osc_secret = f"osc-{name}"
    try:
        async with await api_client_from(cp.admin_kubeconfig) as admin:
            await create_node(admin, name)
            creds = await node_agent_credentials(
                admin,
                work / "creds",
                server=cp.server,
                ca_file=cp.ca_file,
                node_name=name,
                secret_names=[osc_secret],
            )
            user = f"system:serviceaccount:kube-system:{creds.service_account}"
            prepared = prepare_agent(node.root, cp, creds, osc_secret=osc_secret)
            doc = yaml.safe_load(prepared.config_file.read_text())
            doc.pop("nodeAgent", None)  # every setting of our own at its default
            setup = prepared.with_config(doc)
            check = setup.config.controllers.systemd_unit_check
            print(
                f"agent: defaults; unit check every {check.sync_period.total_seconds():g}s, "
                f"OSC resync every "
                f"{setup.config.controllers.operating_system_config.sync_period.total_seconds():g}s"
            )
            checksum = await publish_osc(admin, osc_secret, small_osc())
            async with running_agent(setup, host_name=name, systemd=node):
                started = time.monotonic()
                await wait_applied(admin, name, checksum, 120)

                async def reported() -> bool:
                    return await units_ready(admin, name) is not None

                await wait_for(reported, 120, "SystemdUnitsReady on the Node", poll=0.5)
                print(f"applied and condition reported after {time.monotonic() - started:.1f} s")
                await asyncio.sleep(args.settle)
                start = time.time()
                print(f"idle for {args.minutes:g} min ...", flush=True)
                await asyncio.sleep(args.minutes * 60)
                end = time.time()
                condition = await units_ready(admin, name)
            assert condition is not None
            print(
                f"condition at the end: {condition['status']} {condition['reason']} "
                f"(last written {condition['lastHeartbeatTime']})"
            )
        await asyncio.sleep(1)  # the last audit events are flushed
        report(read_audit(audit_log, user), start, end, (end - start) / 60)
    finally:
        node.stop()
        cp.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work} (audit log: {audit_log})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="idle window (default 3)")
    parser.add_argument(
        "--settle", type=float, default=15.0, help="seconds after start-up before the window"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    asyncio.run(main(parser.parse_args()))
