"""The agent loads kubernetes-asyncio's ApiClient without the thousand modules around it."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
from node_agent.kube.client import KubeClient, ApiClientClass, Configuration
loaded = sorted(m for m in sys.modules if m.startswith("kubernetes_asyncio"))
conf = Configuration(host="https://127.0.0.1:1")
print(len(loaded), ApiClientClass.__module__, hasattr(ApiClientClass, "call_api"))
print(" ".join(loaded))
"""


def test_only_the_client_modules_are_loaded() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    count, module, has_call_api = out[0].split()
    assert module == "kubernetes_asyncio.client.api_client"
    assert has_call_api == "True"
    assert int(count) <= 10, out[1]  # the full package is ~900 modules
    assert "kubernetes_asyncio.client.api.core_v1_api" not in out[1]


def test_an_already_imported_package_is_left_as_it_is() -> None:
    from kubernetes_asyncio import client as full

    from node_agent.kube import lean

    api_client, _ = lean.load()
    assert api_client is full.ApiClient
    assert hasattr(full, "CoreV1Api")
