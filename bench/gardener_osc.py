"""A Gardener-shaped reconcile OSC on real containerd and real registries: apply figures.

Boots the test bed (kube-apiserver + etcd, a TLS registry and its pull-through mirror, a
throwaway node running containerd) and the agent in-process with the containerd expander and
``ctr`` images, then prints:
- first apply of the OSC (``tests/testbed/gardener_osc.py``): wall time from the Secret to the
  Node annotation, the apply itself, imageRef pulls, bytes written from images and bytes
  containerd fetched through the mirror, the units started;
- the no-change re-apply (a Secret update with identical osc.yaml, then the periodic resync):
  must pull nothing, fetch nothing and restart nothing;
- the patch update (1.33.0 → 1.33.1): wall time, pulls, bytes, the units restarted (only kubelet
  is right).

Run as root from the repository root:  .venv/bin/python -m bench.gardener_osc
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import time
import uuid

from kubernetes_asyncio import client

from node_agent.containerd.expand import ContainerdExpander
from node_agent.containerd.images import CtrImages
from tests.conftest import api_client_from, cache_dir
from tests.testbed import gardener_osc as g
from tests.testbed.agent_harness import OSCAgent, wait_for
from tests.testbed.containerd import containerd_node
from tests.testbed.controlplane import ControlPlane
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry

# Combined log format: "GET /v2/<repo>/blobs/<digest> HTTP/1.1" 200 <bytes> "<referer>" "<agent>"
_LINE = re.compile(r'"(?:GET|HEAD) (/v2/\S+) HTTP/[0-9.]+" 200 (\d+|-) "[^"]*" "containerd/')


def fetched(registry: Registry, repositories: tuple[str, ...]) -> tuple[int, int]:
    """Requests and response bytes containerd got from ``registry`` for ``repositories``."""
    count = size = 0
    text = registry.log_path.read_text(errors="replace")
    for match in _LINE.finditer(text):
        if any(match.group(1).startswith(f"/v2/{r}/") for r in repositories):
            count += 1
            size += int(match.group(2)) if match.group(2) != "-" else 0
    return count, size


def mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB" if size >= 2**16 else f"{size} B"


async def main(args: argparse.Namespace) -> None:
    work = cache_dir() / "bench" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    ca = CertificateAuthority(work / "registry-pki", name="node-agent-bench-registry-ca")
    cp = ControlPlane(work / "cp")
    cp.start()
    registry = Registry(work / "registry", ca)
    mirror = Registry(work / "mirror", ca, name="mirror", upstream=registry)
    registry.start()
    mirror.start()
    try:
        with containerd_node(work / "nodes", ca.cert_path) as node:
            g.unmask(node.node, g.SYSCTL)
            suffix = uuid.uuid4().hex[:8]
            pool = g.GardenerPool.fresh(registry, mirror)
            pool.push_images(("1.33.0", "1.33.1"))
            repositories = (pool.hyperkube, pool.shipper)
            images = CtrImages(root=node.node.root, argv_prefix=node.nsenter_argv)
            async with await api_client_from(cp.admin_kubeconfig) as admin:
                agent = OSCAgent(
                    admin, cp, node.node, work, images=images, expander=ContainerdExpander
                )
                async with agent.running():
                    assert agent.controller is not None
                    controller = agent.controller

                    # 1. first apply
                    before = g.unit_marks(node.node)
                    t0 = time.perf_counter()
                    await agent.wait_applied(await agent.publish(pool.osc("1.33.0")), timeout=300)
                    wall = time.perf_counter() - t0
                    report = controller.last_outcome.report if controller.last_outcome else None
                    assert report is not None
                    requests, size = fetched(mirror, repositories)
                    direct, _ = fetched(registry, repositories)
                    started = g.started_again(before, g.unit_marks(node.node))
                    print(
                        f"first apply ({len(g.UNITS)} units, "
                        f"{len(pool.osc()['spec']['files'])} files): {wall:.2f} s wall "
                        f"(apply itself {report.duration:.2f} s)"
                    )
                    print(
                        f"  pulls: {len(report.pulls)} "
                        + ", ".join(
                            f"{p.target} {mib(p.size)} in {p.seconds:.2f} s" for p in report.pulls
                        )
                    )
                    print(
                        f"  containerd fetched {requests} manifests/blobs, {mib(size)}, through "
                        f"the mirror; {direct} from the registry directly"
                    )
                    print(f"  units started: {len(started)} ({', '.join(sorted(started))})")

                    # 2. the same OSC again: a Secret update, then the resync
                    before = g.unit_marks(node.node)
                    reconciles = controller.reconciles
                    t0 = time.perf_counter()
                    patch = {"metadata": {"annotations": {"node-agent-bench/touched": suffix}}}
                    await client.CoreV1Api(admin).patch_namespaced_secret(
                        agent.secret_name, "kube-system", patch
                    )
                    await wait_for(lambda: controller.reconciles > reconciles, 30, "the event")
                    event = time.perf_counter() - t0
                    assert agent.ctx is not None
                    secret = await agent.ctx.kube.get_secret("kube-system", agent.secret_name)
                    t0 = time.perf_counter()
                    outcome = await controller.reconcile(secret, resync=True)
                    resync = time.perf_counter() - t0
                    again, _ = fetched(mirror, repositories)
                    restarted = g.started_again(before, g.unit_marks(node.node))
                    print(
                        f"no-change re-apply: Secret event handled {event:.2f} s after the "
                        f"update; resync {resync * 1e3:.0f} ms; applied again: "
                        f"{outcome is not None}; new fetches {again - requests}; "
                        f"units restarted {len(restarted)}"
                    )
                    if outcome is not None or again != requests or restarted:
                        print("  WRONG: the same OSC must pull and restart nothing")

                    # 3. the patch update
                    before = g.unit_marks(node.node)
                    t0 = time.perf_counter()
                    await agent.wait_applied(await agent.publish(pool.osc("1.33.1")), timeout=300)
                    wall = time.perf_counter() - t0
                    report = controller.last_outcome.report if controller.last_outcome else None
                    assert report is not None
                    after_requests, after_size = fetched(mirror, repositories)
                    restarted = g.started_again(before, g.unit_marks(node.node))
                    print(
                        f"patch update 1.33.0 -> 1.33.1: {wall:.2f} s wall (apply itself "
                        f"{report.duration:.2f} s), pulls {len(report.pulls)} "
                        f"({mib(sum(p.size for p in report.pulls))} written), containerd fetched "
                        f"{after_requests - requests} manifests/blobs, "
                        f"{mib(after_size - size)}"
                    )
                    print(f"  units restarted: {', '.join(sorted(restarted)) or 'none'}")
                    if restarted != {g.KUBELET}:
                        print("  WRONG: exactly kubelet.service must restart")
    finally:
        mirror.stop()
        registry.stop()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    asyncio.run(main(parser.parse_args()))
