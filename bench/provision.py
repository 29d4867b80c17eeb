"""A machine from Gardener's own generated user data to an updated node: how long each step takes.

Boots the test bed (kube-apiserver + etcd, kube-controller-manager signing CSRs, the Gardener-like
CSR approver, a TLS registry, a throwaway node running containerd) and plays, per round,
``tests/testbed/gardener_provision.py`` on a fresh node: gardener-gen's ``init.sh`` pulls
node-agent's image under Gardener's name through a mirror ``hosts.toml``, the agent gets a
certificate for an MCM-length machine name, applies the reconcile OSC (replacing itself by the
OSC's unit and binary), whose real kubelet registers the Node and makes it Ready, Gardener's
restart annotation, then a Kubernetes patch update. Prints per round and the median: user data
-> certificate, -> Node registered, -> reconcile OSC applied (Node annotated), -> Node Ready;
restart annotation -> kubelet healthy; update published -> applied, -> version label, -> agent
restarted, -> the new kubelet reported.

Run as root from the repository root:  .venv/bin/python -m bench.provision [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
import uuid

from bench.machine_bed import machine_bed
from tests.conftest import cache_dir
from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed.agent_image import agent_image_layout
from tests.testbed.containerd import containerd_node
from tests.testbed.csr_approver import CSRApprover


async def main(args: argparse.Namespace) -> None:
    work = cache_dir() / "bench" / f"provision-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    clock = time.monotonic()
    image = agent_image_layout(work / "image-dist")
    print(f"agent image ({image.version}): {time.monotonic() - clock:.1f} s (cached by its key)")
    rounds: list[dict[str, float]] = []
    try:
        async with machine_bed(work) as bed:
            for number in range(1, args.rounds + 1):
                network = rk.PodNetwork.unique()
                try:
                    with containerd_node(work / f"nodes-{number}", bed.registry_ca.cert_path) as n:
                        async with CSRApprover(bed.admin) as approver:
                            run = await gp.provision_from_user_data(
                                bed.admin,
                                bed.control_plane,
                                approver,
                                n,
                                bed.registry,
                                image,
                                network=network,
                            )
                finally:
                    network.remove()
                rounds.append(run.timings)
                print(
                    f"round {number} (machine {run.machine}, {len(run.machine)} characters; "
                    f"the update restarted {', '.join(sorted(run.update_restarted))}):"
                )
                for step, seconds in run.timings.items():
                    print(f"  {step:38} {seconds:6.1f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(rounds) > 1:
        print(f"median of {len(rounds)} rounds:")
        for step in rounds[0]:
            print(f"  {step:38} {statistics.median(r[step] for r in rounds):6.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
