"""node-agent and upstream gardener-node-agent on identical VMs, one after the other in one run.

Each VM is ``tests/testbed/vm_node.py``'s machine: the bed's Debian image booted by QEMU with
Gardener v1.150.0's unchanged provision user data for an in-place pool with a 1 GiB kubelet data
volume. The only difference is the image served as Gardener's node-agent: node-agent's own, or
upstream's binary of the same release (built from its Go module). Each goes through provision ->
Node Ready -> a pod -> the Kubernetes patch update -> the in-place OS update with the machine's
reboot, and the bench prints, side by side, the seconds of each step and the agent's
whole-service PSS on the VM (the image's probe logs it every 30 s). A step that fails is shown
with its error, and the run goes on with the next step.

Run as root from the repository root:  .venv/bin/python -m bench.vm_node
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field

from kubernetes_asyncio.client.exceptions import ApiException

from bench.machine_bed import MachineBed, machine_bed
from tests.conftest import cache_dir
from tests.testbed import oci, vm_node
from tests.testbed.agent_image import agent_image_layout, read_layout
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.systemd_ns import HarnessError

#: a pod that is not running by then is a failed step here (the test waits longer)
POD_TIMEOUT = 300.0


@dataclass
class Outcome:
    """One agent's run: seconds per milestone, failed steps, the PSS samples."""

    agent: str
    timings: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    pss_kib: list[int] = field(default_factory=list)
    patch_started: set[str] = field(default_factory=set)


async def _step(outcome: Outcome, name: str, step: Awaitable[object]) -> bool:
    try:
        await step
    except (TimeoutError, HarnessError, AssertionError, ApiException) as exc:
        outcome.failed[name] = " ".join(str(exc).split())[:200] or type(exc).__name__
        return False
    return True


async def one_vm(name: str, image: oci.Image | oci.Index, bed: MachineBed, work: str) -> Outcome:
    outcome = Outcome(name)
    admin, ca = bed.admin, bed.registry_ca.cert_path.read_bytes()
    async with (
        CSRApprover(admin) as approver,
        vm_node.powered_on(
            admin, bed.control_plane, bed.registry, ca, image, cache_dir() / work / name
        ) as (vm, run, (_, patch, os_update)),
    ):
        if await _step(
            outcome, "provision", vm_node.provision(admin, run.machine, vm, approver, run)
        ):
            clock = time.monotonic()
            if await _step(outcome, "pod", vm_node.run_pod(admin, run.machine, POD_TIMEOUT)):
                run.timings["pod created -> running"] = time.monotonic() - clock
            if await _step(outcome, "patch update", vm_node.patch_update(admin, vm, run, patch)):
                outcome.patch_started = run.patch_started
            await _step(outcome, "OS update", vm_node.os_update(admin, vm, run, os_update))
        outcome.timings = dict(run.timings)
        outcome.pss_kib = vm_node.agent_pss_kib(vm.journal_since())
    return outcome


def report(outcomes: list[Outcome]) -> None:
    steps = list(dict.fromkeys(k for o in outcomes for k in o.timings))
    width = max(len(s) for s in steps) if steps else 20
    print(f"{'seconds':{width}}  " + "  ".join(f"{o.agent:>14}" for o in outcomes))
    for step in steps:
        cells = [
            f"{o.timings[step]:14.1f}" if step in o.timings else f"{'-':>14}" for o in outcomes
        ]
        print(f"{step:{width}}  " + "  ".join(cells))
    for label, pick in (("PSS MiB, max", max), ("PSS MiB, last", lambda v: v[-1])):
        cells = [
            f"{pick([p for p in o.pss_kib if p]) / 1024:14.1f}" if any(o.pss_kib) else f"{'-':>14}"
            for o in outcomes
        ]
        print(f"{'agent service ' + label:{width}}  " + "  ".join(cells))
    for o in outcomes:
        print(f"{o.agent}: the patch update started {', '.join(sorted(o.patch_started)) or '-'}")
        for step, error in o.failed.items():
            print(f"{o.agent}: {step} failed: {error}")


async def main(args: argparse.Namespace) -> None:
    work = f"bench/vm-{uuid.uuid4().hex[:8]}"
    root = cache_dir() / work
    root.mkdir(parents=True)
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    ours = read_layout(agent_image_layout(root / "image-dist").layout)
    outcomes: list[Outcome] = []
    try:
        async with machine_bed(root) as bed:
            images: dict[str, oci.Image | oci.Index] = {
                "node-agent": ours,
                "upstream": vm_node.upstream_agent_image(),
            }
            for name in args.agents:
                clock = time.monotonic()
                outcomes.append(await one_vm(name, images[name], bed, work))
                print(f"{name}: the VM's run took {time.monotonic() - clock:.0f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    report(outcomes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--agents",
        nargs="+",
        default=["node-agent", "upstream"],
        choices=["node-agent", "upstream"],
    )
    parser.add_argument("--keep", action="store_true", help="keep the VMs' consoles and journals")
    asyncio.run(main(parser.parse_args()))
