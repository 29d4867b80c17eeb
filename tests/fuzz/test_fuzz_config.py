"""Fuzz: the agent's NodeAgentConfiguration file through ``config.decode_config`` and
``parse_config``: a file is accepted or refused with a ConfigError, within the per-example
bound (an unknown field nested thousands deep, a billion-laughs file); an accepted file names
token path that could never be right or that is the agent's own which the token controller
would write."""

from __future__ import annotations

import posixpath
import tempfile
from pathlib import Path

import pytest
from hypothesis import given

from node_agent.base import layout
from node_agent.config import NodeAgentConfiguration, decode_config, parse_config
from node_agent.context import AgentContext
from node_agent.controllers.token import refusal
from tests.fuzz import harness
from tests.fuzz.harness import bounded, budget, expect, only
from tests.fuzz.strategies import alias_bomb, config_texts, deep_text
from tests.testbed.config_cases import GARDENER_RENDERED
from tests.unit.fakes import make_ctx

#: a failure takes minutes to shrink; a pass takes seconds
pytestmark = pytest.mark.timeout(900)

#: the agent's own files: a token sync must never write one of them (issue 33, finding 7);
#: credentials/token is the one a standalone install's kubeconfig reads and the sync rotates
OWN_FILES = (layout.RESERVED_FILES | layout.RESERVED_DIRS) - {layout.TOKEN_FILE}


def _sync(path: str) -> str:
    return GARDENER_RENDERED.replace(
        "  token:\n",
        f"  token:\n    syncConfigs:\n    - secretName: gardener-node-agent\n      path: {path}\n",
    )


def _token_path_problem(path: str) -> str | None:
    """Why a token sync path can never be right, or is the agent's own; None when usable."""
    if "\x00" in path:
        return "contains a NUL byte"
    if not path.startswith("/"):
        return "is not absolute"
    if ".." in path.split("/"):
        return "contains '..'"
    if path.endswith("/"):
        return "names a directory"
    if posixpath.normpath(path) in OWN_FILES:
        return "is one of the agent's own files"
    return None


def _check_accepted(config: NodeAgentConfiguration) -> None:
    """Upstream's decode accepts any token path, and so does ours; the token controller must
    then refuse each one that could never be right or is the agent's own (finding 7)."""
    if not config.controllers.token.sync_configs:
        return
    with tempfile.TemporaryDirectory() as root:
        ctx: AgentContext = make_ctx(Path(root), config=config, node_name=None, node_uid=None)
        for index, sync in enumerate(config.controllers.token.sync_configs):
            problem = _token_path_problem(sync.path)
            if problem is not None:
                expect(
                    refusal(ctx, sync.path) is not None,
                    "token sync (paths)",
                    f"token syncConfigs[{index}].path {sync.path!r} {problem}, and the token "
                    "controller would write it (issue 33, finding 7)",
                    key=problem,
                )


def check(text: str) -> None:
    raw = text.encode("utf-8", "surrogatepass")
    with only(harness.CONFIG, "decode_config"):
        decode_config(raw, source="fuzz")
    with only(harness.CONFIG, "parse_config") as outcome:
        config = parse_config(raw, source="fuzz")
    if outcome.refused is None:
        _check_accepted(config)


@pytest.mark.parametrize(
    "text",
    [
        GARDENER_RENDERED + f"unknownDeep: {deep_text(1000, 'map')}\n",
        GARDENER_RENDERED + f"bomb: {alias_bomb(9, 10)}\n",
        _sync("relative/token"),
        _sync('"/var/lib/x/tok\\0en"'),
        _sync(layout.KUBECONFIG_FILE),
        GARDENER_RENDERED + "nodeAgent:\n  healthGate:\n    settleWindow: 99999999999999h\n",
    ],
    ids=[
        "unknown-field-1000-deep",
        "billion-laughs",
        "token-path-relative",
        "token-path-nul",
        "token-path-own-kubeconfig",
        "duration-overflow",
    ],
)
def test_a_config_known_to_break_the_decode_is_refused_typed(text: str) -> None:
    """Issue 33's inputs (findings 4 and 7) and this harness's (a duration past what a
    timedelta holds): refused with a ConfigError naming the field, within the bound."""
    harness.example(text)
    with bounded("config decode (a known input)"):
        check(text)


@budget(short=80)
@given(text=config_texts())
def test_a_config_is_accepted_or_refused_with_a_config_error(text: str) -> None:
    harness.example(text)
    with bounded("config decode"):
        check(text)
