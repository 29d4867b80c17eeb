"""A randomized campaign on a containerd node: registries and containerd's own file misbehave,
and the rest of each OSC still applies, and the next good OSC converges.

The companion of test_apply_campaign.py (kills, units, templates, state files) for the fault
kinds that need containerd and a registry: one throwaway node running real containerd, the
agent's OSC controller with the containerd expander and ``ctr`` images, a real registry. Each of
``NODE_AGENT_CONTAINERD_CAMPAIGN_SCENARIOS`` (default 48) seeded scenarios
(``NODE_AGENT_CAMPAIGN_SEED``) changes an image file (a new image each time), the sandbox image
in ``config.toml`` and a plain unit's file, with one fault drawn:

- a registry that hangs in the middle of a layer, a tag the registry does not have, a registry
  that refuses connections (the image file's item fails after the pull timeout or at once);
- ``config.toml`` not TOML, a directory, of an unknown ``version`` (99, a string), or replaced by
  a valid version 1 file as containerd 1.x nodes carry (not a fault: patched in its own keys);
- none.

The faulty OSC must still apply everything else (the plain unit restarted once with its new
file), never write the failed item or restart its unit, and name the item in a Warning; then the
fault is repaired and a good OSC must converge: checksum on the Node, the image file and the
unit using it at the newest image, containerd reading the newest sandbox image
(``containerd config dump``), and no unit restarted twice for one change.
"""

from __future__ import annotations

import os
import random
import re
import time
import tomllib
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from node_agent.containerd.expand import ContainerdExpander
from node_agent.containerd.images import CtrImages
from tests.integration.conftest import ContainerdAgent
from tests.testbed import oci
from tests.testbed.agent_harness import (
    OSCAgent,
    inline_file,
    node_events,
    osc_document,
    wait_for,
)
from tests.testbed.containerd import ContainerdNode, config_v1
from tests.testbed.controlplane import free_port
from tests.testbed.pki import CertificateAuthority
from tests.testbed.registry import Registry, StallingRegistry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CONFIG = "/etc/containerd/config.toml"
IMAGE_FILE = "/opt/ccamp/img"
IMAGE_UNIT = "ccamp-img.service"
PLAIN_UNIT = "ccamp-plain.service"
PLAIN_FILE = "/etc/ccamp/plain.conf"
LOG_DIR = "/var/log/ccamp"
PULL_TIMEOUT = 3.0
FAULTS = (
    "hung-registry",
    "missing-tag",
    "refused",
    "config-not-toml",
    "config-directory",
    "config-version-99",
    "config-version-string",
    "config-version-1",
    "none",
)
CONFIG_V1 = config_v1("/etc/containerd/certs.d")


def scenario_count() -> int:
    return int(os.environ.get("NODE_AGENT_CONTAINERD_CAMPAIGN_SCENARIOS", "48"))


def campaign_seed() -> int:
    raw = os.environ.get("NODE_AGENT_CAMPAIGN_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(2**32)


def logging_unit(name: str, tag: str, file: str) -> dict[str, Any]:
    """A unit that logs ``<tag> <its file's content> <time>`` on every start."""
    record = f'echo "{tag}/$$(cat {file}) $$(date +%%s.%%N)" >> {LOG_DIR}/{name}'
    content = (
        "[Unit]\nStartLimitIntervalSec=0\n\n[Service]\n"
        f"ExecStartPre=/bin/sh -c 'mkdir -p {LOG_DIR} && {record}'\n"
        "ExecStart=/bin/sleep infinity\n\n[Install]\nWantedBy=multi-user.target\n"
    )
    return {"name": name, "content": content, "enable": True, "filePaths": [file]}


@dataclass
class Figures:
    scenarios: int = 0
    converged: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    faulty_items_held: int = 0  # the failed item left as it was, its unit not restarted
    rest_applied: int = 0  # the plain unit restarted with its new file despite the fault
    warnings_named: int = 0
    restarted_twice: list[str] = field(default_factory=list)
    images_pushed: int = 0

    def summary(self, seed: int, seconds: float) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items()))
        return (
            f"containerd campaign seed {seed}: {self.scenarios} scenarios, fault kinds drawn "
            f"({kinds}); the rest of a faulty OSC applied {self.rest_applied}, the failed item "
            f"held {self.faulty_items_held}, Warnings naming it {self.warnings_named}; "
            f"converged {self.converged}/{self.scenarios}; {self.images_pushed} images pushed; "
            f"units restarted more than once per change: {len(self.restarted_twice)}; "
            f"{seconds:.0f} s"
        )


class Campaign:
    def __init__(
        self,
        agent: OSCAgent,
        cn: ContainerdNode,
        registry: Registry,
        stalling: StallingRegistry,
        seed: int,
    ) -> None:
        self.agent, self.cn, self.node = agent, cn, cn.node
        self.registry, self.stalling, self.seed = registry, stalling, seed
        self.repository = f"ccamp/img-{uuid.uuid4().hex[:8]}"
        self.figures = Figures()
        self.gen = 0
        self.image_gen = 0
        self.plain_gen = 0
        self.sandbox_gen = 0

    def push_image(self) -> str:
        self.gen += 1
        self.image_gen = self.gen
        image = oci.build_image({"/img": (f"img-{self.gen}\n".encode(), 0o644)})
        self.registry.push(self.repository, f"v{self.gen}", image)
        self.figures.images_pushed += 1
        return self.registry.ref(self.repository, f"v{self.gen}")

    def osc(self, image: str) -> dict[str, Any]:
        image_file = {
            "path": IMAGE_FILE,
            "permissions": 0o644,
            "content": {"imageRef": {"image": image, "filePathInImage": "/img"}},
        }
        doc = osc_document(
            [image_file, inline_file(PLAIN_FILE, f"plain-{self.plain_gen}\n")],
            [
                logging_unit(IMAGE_UNIT, "I", IMAGE_FILE),
                logging_unit(PLAIN_UNIT, "P", PLAIN_FILE),
            ],
        )
        doc["spec"]["criConfig"] = {
            "name": "containerd",
            "cgroupDriver": "systemd",
            "containerd": {"sandboxImage": f"registry.k8s.io/pause:3.{self.sandbox_gen}"},
        }
        return doc

    def starts(self, unit: str) -> list[str]:
        try:
            text = self.node.path(f"{LOG_DIR}/{unit}").read_text()
        except FileNotFoundError:
            return []
        return [line.split(" ", 1)[0] for line in text.splitlines()]

    def file(self, path: str) -> str | None:
        host = self.node.path(path)
        return host.read_text() if host.is_file() else None

    def sandbox(self) -> str:
        dump = self.node.run(["containerd", "config", "dump"]).stdout
        cri = tomllib.loads(dump)["plugins"]["io.containerd.grpc.v1.cri"]
        return str(cri["sandbox_image"])

    async def warning_count(self, needle: str) -> int:
        """Warnings naming ``needle`` so far (repeats of one message count each time)."""
        events = await node_events(self.agent.admin, self.agent.node_name)
        return sum(
            e.count or 1 for e in events if e.type == "Warning" and needle in (e.message or "")
        )

    def judge(self, scenario: int) -> None:
        for unit in (IMAGE_UNIT, PLAIN_UNIT):
            seen = self.starts(unit)
            for tag in set(seen):
                if seen.count(tag) > 1:
                    key = f"{unit} {tag} started {seen.count(tag)} times (scenario {scenario})"
                    if key not in self.figures.restarted_twice:
                        self.figures.restarted_twice.append(key)

    async def warm_up(self) -> None:
        self.sandbox_gen = 1
        checksum = await self.agent.publish(self.osc(self.push_image()))
        await self.agent.wait_applied(checksum, timeout=120)

    def plant(self, fault: str) -> bytes:
        """The fault on the node's config.toml; returns the good bytes to put back."""
        config = self.node.path(CONFIG)
        good = config.read_bytes()
        if fault == "config-not-toml":
            config.write_bytes(b"[plugins\n")
        elif fault == "config-directory":
            config.unlink()
            config.mkdir()
        elif fault in ("config-version-99", "config-version-string"):
            value = b"99" if fault == "config-version-99" else b'"2"'
            text, found = re.subn(rb"(?m)^version = \d+$", b"version = " + value, good)
            config.write_bytes(text if found else b"version = " + value + b"\n" + good)
        elif fault == "config-version-1":
            config.write_text(CONFIG_V1)
        return good

    def repair(self, fault: str, good: bytes) -> None:
        config = self.node.path(CONFIG)
        if fault == "config-directory":
            config.rmdir()
        if fault.startswith("config-") and fault != "config-version-1":
            config.write_bytes(good)

    async def scenario(self, index: int) -> str:
        rng = random.Random(f"{self.seed}/{index}")
        fault = rng.choice(FAULTS)
        self.figures.faults[fault] = self.figures.faults.get(fault, 0) + 1
        image_before = self.file(IMAGE_FILE)
        img_starts = len(self.starts(IMAGE_UNIT))
        self.plain_gen += 1
        self.sandbox_gen += 1
        good_ref = self.push_image()
        ref = {
            "hung-registry": self.stalling.ref(),
            "missing-tag": self.registry.ref(self.repository, "v-missing"),
            "refused": f"127.0.0.1:{free_port()}/ccamp/refused:v1",
        }.get(fault, good_ref)
        failed_item = {
            "hung-registry": IMAGE_FILE,
            "missing-tag": IMAGE_FILE,
            "refused": IMAGE_FILE,
            "config-not-toml": CONFIG,
            "config-directory": CONFIG,
            "config-version-99": CONFIG,
            "config-version-string": CONFIG,
        }.get(fault)
        warned = await self.warning_count(f"{failed_item}: ") if failed_item else 0
        good = self.plant(fault)
        planted = self.node.path(CONFIG)
        planted_bytes = planted.read_bytes() if planted.is_file() else None
        await self.agent.publish(self.osc(ref))
        # The rest of the OSC: the plain unit runs its new file, whatever failed.
        want = f"P/plain-{self.plain_gen}"
        await wait_for(lambda: want in self.starts(PLAIN_UNIT), 60, f"{PLAIN_UNIT} restarted")
        self.figures.rest_applied += 1
        if failed_item is not None:

            async def named() -> bool:
                return await self.warning_count(f"{failed_item}: ") > warned

            await wait_for(named, 30 + PULL_TIMEOUT, f"a Warning naming {failed_item}", poll=0.2)
            self.figures.warnings_named += 1
            if failed_item == IMAGE_FILE:
                assert self.file(IMAGE_FILE) == image_before, fault
                assert len(self.starts(IMAGE_UNIT)) == img_starts, fault
                assert self.sandbox() == f"registry.k8s.io/pause:3.{self.sandbox_gen}", fault
            elif planted_bytes is None:
                assert planted.is_dir(), fault
            else:
                assert planted.read_bytes() == planted_bytes, fault
            self.figures.faulty_items_held += 1
        self.repair(fault, good)
        checksum = await self.agent.publish(self.osc(good_ref))
        started = time.monotonic()
        await self.agent.wait_applied(checksum, timeout=60)
        want_img = f"I/img-{self.image_gen}"
        await wait_for(lambda: want_img in self.starts(IMAGE_UNIT), 30, f"{IMAGE_UNIT} newest")
        assert self.file(IMAGE_FILE) == f"img-{self.image_gen}\n"
        assert self.sandbox() == f"registry.k8s.io/pause:3.{self.sandbox_gen}"
        self.figures.converged += 1
        self.figures.scenarios += 1
        self.judge(index)
        return f"{fault} -> converged {time.monotonic() - started:.1f} s after the repair"


async def test_registry_and_containerd_config_faults_never_hold_the_rest_and_converge(
    containerd_agent: ContainerdAgent,
    containerd_node: ContainerdNode,
    registry: Registry,
    registry_ca: CertificateAuthority,
) -> None:
    seed, scenarios = campaign_seed(), scenario_count()
    print(f"containerd campaign seed {seed} (NODE_AGENT_CAMPAIGN_SEED={seed} replays it)")
    node = containerd_node.node
    images = CtrImages(root=node.root, argv_prefix=containerd_node.nsenter_argv)
    images.pull_timeout = PULL_TIMEOUT
    containerd_node.trust(registry.host)
    stalled = oci.build_image({"/img": (b"never arrives\n" * 4096, 0o644)})
    started = time.monotonic()
    with StallingRegistry(registry_ca, "ccamp/stalling", "v1", stalled) as stalling:
        containerd_node.trust(stalling.host)
        async with containerd_agent(images=images, expander=ContainerdExpander) as agent:
            campaign = Campaign(agent, containerd_node, registry, stalling, seed)
            try:
                await campaign.warm_up()
                for index in range(scenarios):
                    print(f"scenario {index}: {await campaign.scenario(index)}")
            finally:
                print(campaign.figures.summary(seed, time.monotonic() - started))
    figures = campaign.figures
    assert figures.converged == scenarios
    assert figures.restarted_twice == [], figures.restarted_twice
