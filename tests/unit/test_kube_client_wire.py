"""The real Kubernetes client against an API server scripted at the HTTP level
(``wire_apiserver``): the token re-read from its file, the one retry after a 401, the typed
errors, the request deadline, the rebuild when the kubeconfig changes, and a watch stream cut
into events wherever its chunks end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from node_agent.base.errors import (
    KubeConflict,
    KubeGone,
    KubeServerError,
    KubeTimeout,
    KubeTransportError,
    KubeUnauthorized,
)
from node_agent.kube.client import KubeClient, Timeouts
from tests.unit.wire_apiserver import Answer, WireAPIServer, started, status_body

pytestmark = pytest.mark.usefixtures("virtual_clock")

LEASE = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/x"
SECRETS = "/api/v1/namespaces/kube-system/secrets"
LEASE_BODY = {"kind": "Lease", "metadata": {"name": "x", "resourceVersion": "7"}}


@pytest_asyncio.fixture
async def api() -> AsyncIterator[WireAPIServer]:
    async with started() as server:
        yield server


def token_kubeconfig(tmp_path: Path, server: str, token_file: Path) -> Path:
    path = tmp_path / "kubeconfig"
    doc = {
        "current-context": "c",
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
        "clusters": [{"name": "k", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"tokenFile": str(token_file)}}],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # as a writer replaces it: the client must never read half a file
    return path


def write_token(path: Path, token: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(token + "\n")
    tmp.replace(path)


@pytest_asyncio.fixture
async def client(api: WireAPIServer, tmp_path: Path) -> AsyncIterator[KubeClient]:
    token = tmp_path / "token"
    write_token(token, "first")
    async with KubeClient.from_kubeconfig(
        token_kubeconfig(tmp_path, api.url, token),
        timeouts=Timeouts(connect=1.0, read=1.0, total=1.0),
    ) as kube:
        yield kube


async def test_each_request_carries_the_token_in_its_file_now(
    api: WireAPIServer, client: KubeClient, tmp_path: Path
) -> None:
    api.answer("GET", LEASE, Answer(body=LEASE_BODY))
    assert await client.get_lease("kube-system", "x") == LEASE_BODY
    write_token(tmp_path / "token", "second")
    await client.get_lease("kube-system", "x")
    assert [r.authorization for r in api.seen("GET", LEASE)] == ["Bearer first", "Bearer second"]
    assert client.stats.token_reloads == 1
    assert client.stats.unauthorized_retries == 0
    assert api.requests[0].user_agent.startswith("node-agent/")


async def test_a_401_rereads_the_token_and_retries_once(
    api: WireAPIServer, client: KubeClient
) -> None:
    """A 401 (the token expired while the file was being replaced) is retried once, with the
    token read from its file again; it says nothing against the credentials after that."""
    unauthorized = status_body(401, "Unauthorized", "Unauthorized")
    api.answer("GET", LEASE, Answer(401, unauthorized), Answer(body=LEASE_BODY))
    assert await client.get_lease("kube-system", "x") == LEASE_BODY
    assert len(api.seen("GET", LEASE)) == 2
    assert client.stats.unauthorized_retries == 1
    assert not client.stats.rejected()


async def test_a_second_401_is_the_servers_verdict(api: WireAPIServer, client: KubeClient) -> None:
    api.answer("GET", LEASE, Answer(401, status_body(401, "Unauthorized", "token expired")))
    with pytest.raises(KubeUnauthorized, match="token expired"):
        await client.get_lease("kube-system", "x")
    assert len(api.seen("GET", LEASE)) == 2  # one retry, not a loop
    assert client.stats.rejected()
    api.answer("GET", LEASE, Answer(body=LEASE_BODY))
    await client.get_lease("kube-system", "x")
    assert not client.stats.rejected()  # the latest answer judged them good


@pytest.mark.parametrize(
    ("status", "reason", "error"),
    [(409, "Conflict", KubeConflict), (410, "Expired", KubeGone), (503, "", KubeServerError)],
)
async def test_an_error_answer_is_its_typed_error(
    api: WireAPIServer, client: KubeClient, status: int, reason: str, error: type[Exception]
) -> None:
    api.answer("GET", LEASE, Answer(status, status_body(status, reason, f"said {status}")))
    with pytest.raises(error, match=f"said {status}"):
        await client.get_lease("kube-system", "x")
    assert len(api.seen("GET", LEASE)) == 1  # only a 401 is retried here


async def test_an_answer_later_than_the_deadline_is_a_timeout(
    api: WireAPIServer, client: KubeClient
) -> None:
    api.answer("GET", LEASE, Answer(body=LEASE_BODY, delay=3.0))
    with pytest.raises(KubeTimeout, match="within 1s"):
        await client.get_lease("kube-system", "x")
    assert client.stats.timeouts == 1


async def test_an_answer_that_is_no_json_object_is_a_transport_error(
    api: WireAPIServer, client: KubeClient
) -> None:
    api.answer("GET", LEASE, Answer(body=["not", "an", "object"]))
    with pytest.raises(KubeTransportError, match="not a JSON object"):
        await client.get_lease("kube-system", "x")


async def test_a_changed_kubeconfig_builds_a_client_for_the_new_server(
    api: WireAPIServer, client: KubeClient, tmp_path: Path
) -> None:
    """The kubeconfig names another server (the cluster's address moved): the next request
    goes there, on a client built anew; the old one is closed once nothing uses it."""
    api.answer("GET", LEASE, Answer(body=LEASE_BODY))
    await client.get_lease("kube-system", "x")
    async with started() as moved:
        moved.answer("GET", LEASE, Answer(body={**LEASE_BODY, "moved": True}))
        token_kubeconfig(tmp_path, moved.url, tmp_path / "token")
        assert (await client.get_lease("kube-system", "x"))["moved"] is True
        assert client.stats.rebuilds == 1
        assert client.server == moved.url
        assert len(api.seen("GET", LEASE)) == 1


async def test_a_kubeconfig_being_rewritten_keeps_the_working_client(
    api: WireAPIServer, client: KubeClient, tmp_path: Path
) -> None:
    api.answer("GET", LEASE, Answer(body=LEASE_BODY))
    (tmp_path / "kubeconfig").write_text("{half a docu")
    assert await client.get_lease("kube-system", "x") == LEASE_BODY
    assert client.stats.rebuilds == 0


def _event(kind: str, name: str, rv: str) -> bytes:
    obj: dict[str, Any] = {"kind": "Secret", "metadata": {"name": name, "resourceVersion": rv}}
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


async def test_a_watch_stream_is_cut_into_events_wherever_its_chunks_end(
    api: WireAPIServer, client: KubeClient
) -> None:
    stream = (
        _event("ADDED", "a", "1")
        + b"\n"
        + _event("MODIFIED", "a", "2")
        + _event("DELETED", "a", "3").rstrip(b"\n")
    )  # the last event without its newline: the stream's end closes it
    chunks = [stream[:5], stream[5:70], stream[70:71], stream[71:]]
    api.answer("GET", SECRETS, Answer(chunks=chunks))
    ref = client.secrets("kube-system").ref("watch", "a")
    events = [
        event
        async for event in client.watch_stream(
            SECRETS, ref, query=[("watch", "1")], read_timeout=1.0
        )
    ]
    assert [(e["type"], e["object"]["metadata"]["resourceVersion"]) for e in events] == [
        ("ADDED", "1"),
        ("MODIFIED", "2"),
        ("DELETED", "3"),
    ]
    assert api.seen("GET", SECRETS)[0].query == {"watch": "1"}


async def test_a_watch_refused_as_expired_is_gone(api: WireAPIServer, client: KubeClient) -> None:
    api.answer("GET", SECRETS, Answer(410, status_body(410, "Expired", "too old resource version")))
    ref = client.secrets("kube-system").ref("watch", "a")
    with pytest.raises(KubeGone):
        async for _ in client.watch_stream(SECRETS, ref, query=[], read_timeout=1.0):
            pass


async def test_a_silent_watch_is_a_timeout(api: WireAPIServer, client: KubeClient) -> None:
    """A watch whose server stops sending (a half-open connection) ends at the read timeout."""
    api.answer(
        "GET",
        SECRETS,
        Answer(chunks=[_event("ADDED", "a", "1")]),
        Answer(body=None, delay=2.0),
    )
    ref = client.secrets("kube-system").ref("watch", "a")
    first = [e async for e in client.watch_stream(SECRETS, ref, query=[], read_timeout=0.5)]
    assert len(first) == 1
    with pytest.raises(KubeTimeout):
        async for _ in client.watch_stream(SECRETS, ref, query=[], read_timeout=0.5):
            pass
