"""The agent's controllers come from one list (``agent.CONTROLLERS``), as Gardener's
``controller/add.go`` adds its own: adding a controller is one entry, taking what it needs from
the controllers built before it, and the run loop starts it with the others."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from node_agent.agent import CONTROLLERS, Parts, Running, build_agent
from node_agent.controllers.node import NodeController
from node_agent.controllers.osc.controller import OSCController
from tests.unit.fakes import make_ctx


class Hello:
    """A trivial controller: it says hello to the Node controller once it runs."""

    def __init__(self, node: NodeController) -> None:
        self.node = node
        self.said = asyncio.Event()

    async def run(self) -> None:
        self.said.set()


def add_hello(p: Parts) -> tuple[object, Running]:
    hello = Hello(p.need(NodeController))
    return hello, Running("hello", hello.run, waits=True)


async def test_a_new_controller_is_one_entry_in_one_list(tmp_path: Path) -> None:
    agent = build_agent(
        make_ctx(tmp_path), images=None, expander=None, controllers=(*CONTROLLERS, add_hello)
    )
    names = [r.name for r in agent.running]
    assert names == ["osc", "lease", "node", "token", "health-check", "unitcheck", "hello"]
    hello = agent.need(Hello)
    assert hello.node is agent.need(NodeController)
    assert agent.running[-1].waits  # after the OSC controller's first reconcile, as the checks
    await agent.running[-1].run()
    assert hello.said.is_set()


async def test_every_controller_is_on_the_read_side(tmp_path: Path) -> None:
    """What ``status``, the probes and the metrics read is registered by the entries."""
    sources = build_agent(make_ctx(tmp_path), images=None, expander=None).sources
    for name in ("osc", "lease", "node", "unitcheck", "healthcheck", "gate", "guard", "rollout"):
        assert getattr(sources, name) is not None, name


async def test_a_controller_needing_one_built_after_it_is_named(tmp_path: Path) -> None:
    with pytest.raises(LookupError, match="no OSCController built before"):
        build_agent(
            make_ctx(tmp_path),
            images=None,
            expander=None,
            controllers=tuple(add for add in CONTROLLERS if add.__name__ != "add_osc"),
        )
    assert OSCController in {
        type(c)
        for c in build_agent(make_ctx(tmp_path), images=None, expander=None).parts.built.values()
    }
