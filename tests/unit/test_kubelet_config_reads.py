"""A kubelet config file the agent reads (from an OSC for an in-place update, from the disk for
the kubelet's health endpoint) never ends the agent, however it is nested or aliased."""

from __future__ import annotations

import time

import pytest

from node_agent.controllers.healthcheck import kubelet_healthz_url
from node_agent.osc import inplace as ip
from tests.unit.test_inplace import osc

DEFAULT_URL = "http://127.0.0.1:10248/healthz"
DEEP = b"healthzPort: 10300\nx: " + b"[" * 3000 + b"]" * 3000 + b"\n"
#: seven levels of ten references each: 10^7 values once expanded (a string of 50 MB)
LAUGHS = b"a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + b"".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n".encode() for i in range(1, 7)
)


@pytest.mark.parametrize(
    ("config", "url"),
    [
        (DEEP, DEFAULT_URL),
        # no such date: a plain string, as Go reads it (PyYAML's loader raised ValueError)
        (b"healthzPort: 10300\nwhen: 2026-13-45\n", "http://127.0.0.1:10300/healthz"),
        (LAUGHS + b"healthzPort: *a6\nhealthzBindAddress: *a6\n", DEFAULT_URL),
        (b"healthzPort: 10300\nhealthzBindAddress: 127.0.0.2\n", "http://127.0.0.2:10300/healthz"),
    ],
    ids=["nested-3000-deep", "bad-timestamp", "billion-laughs", "plain"],
)
def test_the_health_endpoint_is_read_from_any_kubelet_config(config: bytes, url: str) -> None:
    started = time.monotonic()
    assert kubelet_healthz_url(None, config) == url
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    "config",
    [
        DEEP,
        b"kind: [unclosed\n",
        LAUGHS + b"cpuManagerPolicy: *a6\n",
        LAUGHS + b"evictionHard:\n  memory.available: *a6\n",
        LAUGHS + b"kubeReserved:\n  cpu: *a6\n",
    ],
    ids=["nested-3000-deep", "malformed", "laughs-policy", "laughs-eviction",
         "laughs-reserved"],
)  # fmt: skip
def test_an_in_place_kubelet_config_that_cannot_be_read_is_an_in_place_error(
    config: bytes,
) -> None:
    started = time.monotonic()
    with pytest.raises(ip.InPlaceError, match="kubelet config"):
        ip.detect(osc(), osc(config_text=config.decode()), "1877.4")
    assert time.monotonic() - started < 2
