"""The differential twin: upstream gardener-node-agent and node-agent on twin nodes, fed the same
sequence of Gardener-generated OSCs, compared after every step; for each Gardener release of
``TWIN_RELEASES`` (the newest; ``make compat``: every one), upstream's binary of that release on
that release's provision files and OSCs.

Both nodes have the same shape (the bed's containerd node, Gardener's provision files, a
bootstrap token, an MCM machine name, the real kubelet of each step's Kubernetes version, which
registers the Node). Both agents read the pool's one Secret, the one the Node's
``worker.gardener.cloud/gardener-node-agent-secret-name`` label names (the kubelet registers
the Node with it, from the OSC's flags, and both agents follow the label as upstream does).
After each step, once both Nodes report the step's checksum (or, for a step that must fail,
once both have settled), the test compares every OSC file, the unit files and drop-ins, unit
enablement and state, which units started again, containerd's configuration and ``certs.d``,
the Node's annotations, labels and conditions (the kubelet's among them) and the reasons of
the Events about it (the agents'; the kubelet's own are left out). A difference must be in
``KNOWN_DIFFERENCES`` (each one also described in ``docs/design.md``); anything else fails the
test with the step's table.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from node_agent.base.layout import (
    BASE_DIR,
    BOOTSTRAP_TOKEN_FILE,
    KUBECONFIG_FILE,
    KUBELET_BOOTSTRAP_KUBECONFIG,
)
from tests.integration.test_gardener_generated import (
    UPSTREAM_BINARY,
    UPSTREAM_UNIT,
    allow_upstream_caches,
    mcm_machine_name,
    subject_cn,
)
from tests.testbed import gardener_osc as g
from tests.testbed import gardener_provision as gp
from tests.testbed import real_kubelet as rk
from tests.testbed import twin as t
from tests.testbed.agent_harness import (
    host,
    node_annotations,
    publish_osc,
    service,
    wait_for,
)
from tests.testbed.agent_image import agent_image_layout
from tests.testbed.bootstrap import (
    allow_kubelet_bootstrap,
    create_bootstrap_token,
    grant_node_agent_identity,
)
from tests.testbed.containerd import ContainerdNode
from tests.testbed.containerd import containerd_node as start_containerd_node
from tests.testbed.controlplane import ControlPlane, free_port
from tests.testbed.csr_approver import CSRApprover
from tests.testbed.gardener_gen import TWIN_RELEASES, Generated, gardener_node_agent, generate
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore:Attribute.s length"),
    pytest.mark.timeout(900),
]

CHECKSUM = "checksum/cloud-config-data"
RESTART_ANNOTATION = "worker.gardener.cloud/restart-systemd-services"
#: Gardener's image references, replaced by the bed's registry (no network): same tag, the real
#: kubelet of that version inside (tests/testbed/real_kubelet.py)
HYPERKUBE = "europe-docker.pkg.dev/gardener-project/releases/hyperkube:v"
VERSIONS = ("1.33.0", "1.34.0", "1.34.2")
#: the unit check's period on both twins (seconds; Gardener's default is a minute, its minimum
#: 15 s) and how long the test lets both agents settle after they reported a step (one unit
#: check and a bit)
UNIT_CHECK_PERIOD = 15
SETTLE = UNIT_CHECK_PERIOD + 2.0

#: Not compared, because they must differ between the twins:
EXCLUDED_TREES = (
    # the agent's own unit: installed by the test, the same text on both twins
    f"/etc/systemd/system/{UPSTREAM_UNIT}",
)
#: Gardener's sshd-ensurer.service restarts every 5 s on a node without sshd (the bed's host has
#: none): its state at any moment and its InvocationIDs are the phase of that loop, not what an
#: agent did. containerd-logrotate.service is started by its timer (OnCalendar every 10 min, with
#: systemd's per-host accuracy offset): near a ten-minute mark one twin may run it within a step
#: and the other just after (a CI rehearsal's "create" step at 20:00).
LOOPING_UNITS = ("sshd-ensurer.service", "containerd-logrotate.service")
EXCLUDED_KEYS = (
    *(f"unit {u} {p}" for u in LOOPING_UNITS for p in ("ActiveState", "SubState")),
    # The kubelet health checks' Events (reason "kubelet") depend on whether a probe fell into
    # the kubelet restart of an update (upstream probes every 30 s, node-agent every 20 s) and,
    # for upstream, on whether it looked at the Node before the bed gave it an address.
    "node event kubelet",
    # The node lifecycle controller's record of a moment of NotReady (the kubelet's own Events
    # are left out by the view): both twins restart their kubelet at the same steps (compared
    # by unit), and whether it is seen NotReady depends on its checks' timing, not on an agent.
    "node event NodeNotReady",
)

#: Documented differences (docs/design.md, "Where node-agent differs from upstream" and
#: "Where node-agent does better than upstream"): key prefix -> why node-agent differs.
TEMPLATE_JOBS = (
    "upstream sends a restart job for the template unit by its bare name, which systemd "
    "refuses (missing the instance name): the OSC fails on every retry; node-agent writes a "
    "template's files and sends it no job"
)
RESTART_LOOP = (
    "the unit check: a service waiting in auto-restart after a failed run is healthy for "
    "upstream, forever; node-agent calls it failed (exit-code), restarting"
)
KNOWN_DIFFERENCES: dict[str, t.Known] = {
    # upstream never applied the OSC with the template (above), so the next OSC, planned from
    # upstream's last applied one, does not know the template and never deletes its file
    "tree /etc/systemd/system/twin-tpl@.service": t.Known(TEMPLATE_JOBS),
    # An Event, which Gardener does not read: the SystemdUnitsReady condition itself is
    # upstream's (a service in a Restart= loop, Gardener's sshd-ensurer.service on the bed's
    # node without sshd, is healthy in it); the crash loop is node-agent's own diagnosis.
    "node event SystemdUnitUnhealthy": t.Known(
        "the unit check: upstream sets the condition only; node-agent also sends one Warning "
        "Event SystemdUnitUnhealthy naming the unit when a unit turns unhealthy or into a "
        "Restart= crash loop (not read by Gardener)"
    ),
}


@dataclass
class Twin:
    """One of the two nodes, the agent it runs and the Secret it reads."""

    label: str
    cn: ContainerdNode
    machine: str
    secret: str
    gen: Generated

    @property
    def node(self) -> Any:
        return self.cn.node


@contextlib.contextmanager
def twin_nodes(workdir: Path, ca: CertificateAuthority) -> Iterator[tuple[ContainerdNode, ...]]:
    with (
        start_containerd_node(workdir / "twin-upstream", ca.cert_path) as up,
        start_containerd_node(workdir / "twin-ours", ca.cert_path) as ours,
    ):
        yield up, ours


async def provision_twin(
    label: str,
    cn: ContainerdNode,
    cp: ControlPlane,
    admin: ApiClient,
    release: str,
    *,
    own_secret: bool = False,
) -> Twin:
    """Gardener's provision files on the node, probe ports off the shared host network's
    defaults; the pool's Secret, or with ``own_secret`` one of the twin's own (for Nodes that
    do not name the pool's, as the bench's)."""
    machine = mcm_machine_name()
    cn.node.run(["hostname", machine])
    token = await create_bootstrap_token(admin)
    gen = generate(
        "k8s-1.33",
        machine_name=machine,
        api_server=cp.server,
        ca_file=cp.ca_file,
        bootstrap_token=token.token,
        release=release,
    )
    # the pool's Secret: what the kubelet's Node label will name
    secret = f"{gen.secret_name}-{label}" if own_secret else gen.secret_name
    root = cn.node.root
    await grant_node_agent_identity(admin, machine, secret_names=[secret])
    for file in gen.provision_files:
        if not file.path.startswith(f"{BASE_DIR}/") or file.path.endswith("/init.sh"):
            continue
        target = host(root, file.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(file.content)
        target.chmod(file.permissions if file.permissions is not None else 0o600)
    config_file = host(root, gen.config_path)
    doc = yaml.safe_load(config_file.read_text())
    doc["controllers"]["operatingSystemConfig"]["secretName"] = secret
    doc["server"] = {"healthProbes": {"port": free_port()}, "metrics": {"port": free_port()}}
    # the unit check every few seconds instead of every minute (both agents read this field)
    doc["controllers"]["systemdUnitCheck"] = {"syncPeriod": f"{UNIT_CHECK_PERIOD}s"}
    if label != "upstream":
        # The bed's nodes share the host's network: the twins' kubelets cannot both listen on
        # 127.0.0.1:10248. Upstream's health check only knows that address, so the upstream
        # twin's kubelet keeps it; node-agent's twin's kubelet moves (through the unit's
        # $KUBELET_EXTRA_ARGS) and node-agent is told where (its own config field).
        port = free_port()
        extra = host(root, gp.KUBELET_EXTRA_ARGS)
        extra.parent.mkdir(parents=True, exist_ok=True)
        extra.write_text(f"KUBELET_EXTRA_ARGS=--healthz-port={port}\n")
        doc.setdefault("nodeAgent", {})["healthCheck"] = {
            "kubeletHealthz": f"http://127.0.0.1:{port}/healthz"
        }
    config_file.write_text(yaml.safe_dump(doc))
    return Twin(label, cn, machine, secret, gen)


def give_real_kubelet(twin: Twin, cp: ControlPlane, network: rk.PodNetwork) -> None:
    """What the twin's real kubelet needs before the first OSC starts it, the same on both
    twins: the bootstrap kubeconfig Gardener's bootstrap leaves it (the twins start the agent
    itself, not its bootstrap; made from the node's bootstrap token), the kernel settings it
    checks and a pod network (``real_kubelet.prepare_node``), and through the unit's
    ``$KUBELET_EXTRA_ARGS`` its server port off the shared host network's default and the
    host's cgroups."""
    root = twin.node.root
    token = host(root, BOOTSTRAP_TOKEN_FILE).read_text().strip()
    ca = base64.b64encode(cp.ca_file.read_bytes()).decode()
    name = "kubelet-bootstrap"
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": cp.server, "certificate-authority-data": ca}}
        ],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
        "users": [{"name": name, "user": {"token": token}}],
    }
    target = host(root, KUBELET_BOOTSTRAP_KUBECONFIG)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(kubeconfig))
    target.chmod(0o600)
    kubelet_args = rk.prepare_node(twin.node, twin.gen, network)
    extra = host(root, gp.KUBELET_EXTRA_ARGS)
    line = extra.read_text().rstrip("\n") if extra.exists() else "KUBELET_EXTRA_ARGS="
    extra.write_text(f"{line} {kubelet_args}\n")


async def kubelet_registered(admin: ApiClient, twin: Twin) -> bool:
    return await rk.node_registered(admin, twin.machine)


def install_logrotate(cn: ContainerdNode) -> None:
    """A stand-in ``/usr/sbin/logrotate``: Gardener's ``containerd-logrotate.service`` runs it
    and every Gardener node image has it; the bed's host has none, and without it the unit
    fails on both twins at every step, so that neither would ever report an OSC applied."""
    target = cn.node.path("/usr/sbin/logrotate")
    target.write_text("#!/bin/sh\nexit 0\n")
    target.chmod(0o755)


def install_agent(twin: Twin, binary: bytes) -> None:
    """The agent's binary at Gardener's path and Gardener's own unit for it (from the OSC of
    the first step), started: the same on both twins but for the binary's bytes."""
    root = twin.node.root
    target = host(root, UPSTREAM_BINARY)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(binary)
    target.chmod(0o755)
    (unit,) = [u for u in twin.gen.osc["spec"]["units"] if u["name"] == UPSTREAM_UNIT]
    host(root, f"/etc/systemd/system/{UPSTREAM_UNIT}").write_text(unit["content"])
    twin.node.run(["systemctl", "daemon-reload"])
    twin.node.run(["systemctl", "start", UPSTREAM_UNIT])


def journal(twin: Twin) -> str:
    out = twin.node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", UPSTREAM_UNIT], check=False
    ).stdout
    lines = [ln for ln in out.splitlines() if '"health-check"' not in ln]
    kubelet: str = twin.node.run(
        ["journalctl", "--no-pager", "-o", "cat", "-u", g.KUBELET], check=False
    ).stdout
    return (
        f"--- journal of {twin.label}'s agent ---\n" + "\n".join(lines)[-8000:] + "\n"
        f"--- journal of {twin.label}'s kubelet ---\n" + kubelet[-4000:]
    )


# --- the OSC of each step ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shoot:
    """What a step's OSC is rendered for: the Gardener release, the bed's API server and CA
    (which the kubelet's files name), the pool's images."""

    release: str
    control_plane: ControlPlane
    pool: g.GardenerPool


def base_osc(shape: str, shoot: Shoot) -> dict[str, Any]:
    """Gardener's OSC of ``shape`` for ``shoot`` without the agent's own items, its hyperkube
    image in the bed's registry."""
    cp = shoot.control_plane
    gen = generate(shape, release=shoot.release, api_server=cp.server, ca_file=cp.ca_file)
    text = gen.osc_yaml
    for version in VERSIONS:
        text = text.replace(f"{HYPERKUBE}{version}", shoot.pool.hyperkube_ref(version))
    return t.strip_agent(yaml.safe_load(text))


def with_units(osc: dict[str, Any], *units: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(osc)
    doc["spec"]["units"] = [*doc["spec"]["units"], *units]
    return doc


EXTRA = "twin-extra.service"
TEMPLATE = "twin-tpl@.service"
FAILING = "twin-failing.service"


@dataclass(frozen=True)
class Step:
    name: str
    #: the OSC of the step for the shoot
    osc: Callable[[Shoot], dict[str, Any]]
    #: the agents must report the checksum (False: both must settle without it)
    applies: bool = True
    #: the Node annotation set before the OSC (the restart annotation)
    restart: str = ""
    #: upstream reports it applied (False: a documented upstream failure, node-agent applies)
    upstream_applies: bool = True
    #: differences documented for this step only: key prefix -> why
    known: tuple[tuple[str, t.Known], ...] = ()


STEPS = (
    Step("create", lambda s: base_osc("k8s-1.33", s)),
    Step("registry added", lambda s: base_osc("mirrors", s)),
    Step("registry removed", lambda s: base_osc("k8s-1.33", s)),
    Step("minor update", lambda s: base_osc("k8s-1.34", s)),
    Step("patch update", lambda s: base_osc("k8s-1.34-patch", s)),
    Step(
        "unit added",
        lambda s: with_units(
            base_osc("k8s-1.34-patch", s), service(EXTRA, command="start", enable=True)
        ),
    ),
    Step("unit removed", lambda s: base_osc("k8s-1.34-patch", s)),
    Step(
        "template unit",
        lambda s: with_units(
            base_osc("k8s-1.34-patch", s),
            {"name": TEMPLATE, "content": "[Service]\nExecStart=/bin/sleep infinity\n"},
        ),
        upstream_applies=False,
        known=((f"node annotation {CHECKSUM}", t.Known(TEMPLATE_JOBS)),),
    ),
    # Type=simple: the start job is done once the process is forked; the missing binary fails
    # it after that, so both agents report the OSC and the unit check calls the unit failed
    Step(
        "failing unit",
        lambda s: with_units(
            base_osc("k8s-1.34-patch", s),
            service(
                FAILING,
                "/opt/bin/twin-missing",
                extra="Type=simple\n",
                command="start",
                enable=True,
            ),
        ),
    ),
    Step("restart annotation", lambda s: base_osc("k8s-1.34-patch", s), restart="twin-restart"),
)


async def wait_both(admin: ApiClient, twins: tuple[Twin, ...], checksum: str, step: Step) -> None:
    """Until each agent that must report the step did; then the settle time (a step nobody
    can converge on gets a fixed time for both to try it)."""

    async def reported(twin: Twin) -> bool:
        if not await kubelet_registered(admin, twin):  # the first step's kubelet makes it
            return False
        return (await node_annotations(admin, twin.machine)).get(CHECKSUM) == checksum

    expected = [
        tw for tw in twins if step.applies and (tw.label != "upstream" or step.upstream_applies)
    ]
    for twin in expected:
        await wait_for(lambda tw=twin: reported(tw), 180, f"{twin.label} applying")
    await asyncio.sleep(SETTLE if len(expected) == len(twins) else 20)


@pytest.mark.parametrize("release", TWIN_RELEASES)
async def test_upstream_and_node_agent_do_the_same_on_twin_nodes(
    release: str,
    gardener_controlplane: ControlPlane,
    admin_api: ApiClient,
    csr_approver: CSRApprover,
    workdir: Path,
    registry_ca: CertificateAuthority,
    registry: Registry,
    mirror: Registry,
) -> None:
    pool = g.GardenerPool.fresh(registry, mirror)
    pool.push_images(VERSIONS, kubelet_image=rk.hyperkube_image)
    shoot = Shoot(release, gardener_controlplane, pool)
    await allow_kubelet_bootstrap(admin_api)
    failures: list[str] = []
    networks = (rk.PodNetwork.unique(), rk.PodNetwork.unique())
    with contextlib.ExitStack() as cleanup, twin_nodes(workdir, registry_ca) as (up_node, our_node):
        for network in networks:
            cleanup.callback(network.remove)
        twins: list[Twin] = []
        nodes = (("upstream", up_node), ("ours", our_node))
        for (label, cn), network in zip(nodes, networks, strict=True):
            cn.trust(registry.host)
            install_logrotate(cn)
            g.unmask(cn.node, g.SYSCTL)
            twin = await provision_twin(label, cn, gardener_controlplane, admin_api, release)
            give_real_kubelet(twin, gardener_controlplane, network)
            twins.append(twin)
        upstream, ours = twins
        await allow_upstream_caches(admin_api, upstream.machine)
        install_agent(upstream, gardener_node_agent(release).read_bytes())
        install_agent(ours, agent_image_layout(workdir / "image-dist").executable.read_bytes())
        for twin in twins:
            await wait_for(
                lambda tw=twin: host(tw.node.root, KUBECONFIG_FILE).exists(),
                90,
                f"{twin.label}'s kubeconfig",
            )
            assert subject_cn(host(twin.node.root, KUBECONFIG_FILE)).endswith(twin.machine)
        # no Node yet: the first step's kubelet registers it
        views = {tw.label: t.NodeView() for tw in twins}
        try:
            for step in STEPS:
                osc = step.osc(shoot)
                raw = t.osc_bytes(osc)
                paths, units = t.osc_paths(osc), [*t.osc_units(osc), g.CONTAINERD]
                if step.restart:
                    for twin in twins:
                        await client.CoreV1Api(admin_api).patch_node(
                            twin.machine,
                            {"metadata": {"annotations": {RESTART_ANNOTATION: "kubelet"}}},
                        )
                for secret in sorted({twin.secret for twin in twins}):
                    checksum = await publish_osc(admin_api, secret, raw)
                await wait_both(admin_api, tuple(twins), checksum, step)
                if step.restart:
                    for twin in twins:
                        await wait_for(
                            lambda tw=twin: annotation_gone(admin_api, tw.machine),
                            60,
                            f"{twin.label} restarting",
                        )
                after = {}
                for twin in twins:
                    view = await t.node_view(
                        admin_api,
                        twin.node,
                        twin.machine,
                        paths=paths,
                        units=[*units, EXTRA, FAILING],
                        exclude_trees=EXCLUDED_TREES,
                    )
                    view.add(
                        "restarted",
                        ",".join(sorted(t.restarted(views[twin.label], view) - set(LOOPING_UNITS))),
                    )
                    for key in [k for k in view.items if k.startswith(EXCLUDED_KEYS)]:
                        del view.items[key]
                    after[twin.label] = view
                views = after
                rows = t.compare(
                    after["upstream"], after["ours"], {**KNOWN_DIFFERENCES, **dict(step.known)}
                )
                print(t.table(step.name, rows))
                failures += [
                    f"{step.name}: {r.key}: upstream {r.upstream!r}, ours {r.ours!r}"
                    for r in rows
                    if r.verdict == "differs"
                ]
        finally:
            for twin in twins:
                print(f"--- events of {twin.label} ---")
                print("\n".join(await t.event_messages(admin_api, twin.machine)))
                print(journal(twin))
                twin.node.run(["systemctl", "stop", UPSTREAM_UNIT], check=False)
    assert failures == []


async def annotation_gone(admin: ApiClient, node: str) -> bool:
    return RESTART_ANNOTATION not in await node_annotations(admin, node)
