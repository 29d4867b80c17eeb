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
print("urllib3.util" in sys.modules)
conf.username, conf.password = "u", "p"
print(conf.get_basic_auth_token(), "urllib3.util" in sys.modules)
import urllib3.exceptions
print(urllib3.exceptions.HTTPError.__module__)
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
    assert out[2] == "False"  # urllib3: registered, not loaded ...
    assert out[3] == "Basic dTpw True"  # ... until something of it is used
    assert out[4] == "urllib3.exceptions"


def test_an_already_imported_package_is_left_as_it_is() -> None:
    from kubernetes_asyncio import client as full

    from node_agent.kube import lean

    api_client, _ = lean.load()
    assert api_client is full.ApiClient
    assert hasattr(full, "CoreV1Api")


TRUST_PROBE = """
import ssl, sys
if sys.argv[1] == "lean":
    from node_agent.kube.lean import load_aiohttp
    load_aiohttp()
import aiohttp.connector
verified = aiohttp.connector._SSL_CONTEXT_VERIFIED
unverified = aiohttp.connector._SSL_CONTEXT_UNVERIFIED
after = ssl.create_default_context()
print(*(c.cert_store_stats()["x509_ca"] for c in (verified, unverified, after)))
"""


def trust_anchors(mode: str) -> tuple[int, int, int]:
    """(CA certificates in aiohttp's default verifying context, in its non-verifying one, in a
    default context made afterwards), in a fresh interpreter importing aiohttp ``mode`` = lean |
    plain."""
    out = subprocess.run(
        [sys.executable, "-c", TRUST_PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0]), int(out[1]), int(out[2])


def test_aiohttp_is_imported_without_the_system_trust_store() -> None:
    plain_verified, plain_unverified, plain_after = trust_anchors("plain")
    # what aiohttp costs every start when imported as it comes: the bundle parsed twice
    assert plain_verified > 0
    assert plain_unverified > 0
    lean_verified, lean_unverified, lean_after = trust_anchors("lean")
    assert lean_verified == 0  # nothing trusted: a connection relying on it fails, never passes
    assert lean_unverified == 0
    assert lean_after == plain_after > 0  # ssl's own method is put back


def test_aiohttp_already_imported_is_left_as_it_is() -> None:
    import aiohttp.connector

    from node_agent.kube import lean

    before = aiohttp.connector._SSL_CONTEXT_VERIFIED
    lean.load_aiohttp()
    assert aiohttp.connector._SSL_CONTEXT_VERIFIED is before
