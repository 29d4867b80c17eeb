"""hosts.toml per registry (Gardener's layout, built with tomlkit) and the readiness probe."""

from __future__ import annotations

import http.server
import socket
import threading
import tomllib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.containerd.registries import (
    ca_path,
    hosts_toml,
    hosts_toml_path,
    probe_registry,
    probe_url,
)
from node_agent.containerd.spec import RegistryConfig, RegistryHost


def registry(**fields: Any) -> RegistryConfig:
    return RegistryConfig.model_validate({"upstream": "docker.io", **fields})


def test_layout_of_a_mirror_entry() -> None:
    text = hosts_toml(
        registry(
            server="https://registry-1.docker.io",
            hosts=[
                {"url": "https://mirror.local:5000", "caCerts": ["/etc/ssl/mirror.crt"]},
                {
                    "url": "http://10.0.0.1/v2/docker",
                    "capabilities": ["pull"],
                    "overridePath": True,
                },
            ],
        )
    )
    # upstream's template (containerd-hosts.toml.tpl) renders exactly these bytes
    assert text == (
        "# managed by gardener-node-agent\n"
        'server = "https://registry-1.docker.io"\n'
        "\n"
        '[host."https://mirror.local:5000"]\n'
        '  capabilities = ["pull","resolve"]\n'
        '  ca = ["/etc/ssl/mirror.crt"]\n'
        "\n"
        '[host."http://10.0.0.1/v2/docker"]\n'
        '  capabilities = ["pull"]\n'
        "  override_path = true\n"
        "\n"
    )


def test_without_server_the_hosts_follow_the_comment() -> None:
    text = hosts_toml(registry(hosts=[{"url": "https://m", "overridePath": False}]))
    assert text == (
        "# managed by gardener-node-agent\n"
        '[host."https://m"]\n  capabilities = ["pull","resolve"]\n\n'
    )


def test_strings_are_written_as_upstream_writes_them_and_stay_toml() -> None:
    # Go's toJson escapes <, > and & (HTML-safe), quote does not; both are valid TOML
    text = hosts_toml(registry(hosts=[{"url": "https://m/a&b", "caCerts": ["/ca/<x>.crt"]}]))
    assert text is not None
    assert '[host."https://m/a&b"]\n' in text  # quote (Go's %q) does not escape
    assert '  ca = ["/ca/\\u003cx\\u003e.crt"]\n' in text
    assert tomllib.loads(text)["host"]["https://m/a&b"]["ca"] == ["/ca/<x>.crt"]


def test_a_server_without_hosts_is_its_own_host() -> None:
    # containerd 1.6 refuses a hosts.toml without a [host] table; the server as the only host
    # with the server's own capabilities means the same.
    text = hosts_toml(registry(server="https://registry-1.docker.io"))
    assert text is not None
    assert tomllib.loads(text) == {
        "server": "https://registry-1.docker.io",
        "host": {
            "https://registry-1.docker.io": {"capabilities": ["pull", "resolve", "push"]},
        },
    }


def test_neither_server_nor_hosts_gives_no_file() -> None:
    assert hosts_toml(registry()) is None


def test_paths() -> None:
    assert hosts_toml_path("localhost:5000") == "/etc/containerd/certs.d/localhost:5000/hosts.toml"
    assert ca_path("docker.io", "ca.crt") == "/etc/containerd/certs.d/docker.io/ca.crt"
    assert ca_path("docker.io", "/etc/ca.crt") == "/etc/ca.crt"


_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=20)
# server and host URLs: anything but what spec.py refuses (whitespace, quotes, backslash, controls)
_url_text = st.text(
    st.characters(exclude_categories=["Cs", "Cc", "Cf", "Co", "Cn", "Zs", "Zl", "Zp"]).filter(
        lambda ch: not ch.isspace() and ch not in "\"'\\"
    ),
    max_size=20,
)


@given(
    server=st.none() | _url_text,
    urls=st.lists(_url_text.map(lambda t: "https://" + t), min_size=1, max_size=3, unique=True),
    ca=st.lists(_text, max_size=2),
    override=st.booleans(),
)
def test_any_strings_round_trip_through_a_toml_parser(
    server: str | None, urls: list[str], ca: list[str], override: bool
) -> None:
    hosts = [{"url": u, "caCerts": ca, "overridePath": override} for u in urls]
    text = hosts_toml(registry(server=server, hosts=hosts))
    assert text is not None
    doc = tomllib.loads(text)
    assert doc.get("server") == server
    assert list(doc["host"]) == urls
    for url in urls:
        expected: dict[str, Any] = {"capabilities": ["pull", "resolve"]}
        if ca:
            expected["ca"] = ca
        if override:
            expected["override_path"] = True
        assert doc["host"][url] == expected


# --- the readiness probe -------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    paths: list[str]  # set per server

    def do_GET(self) -> None:
        self.paths.append(self.path)
        self.send_response(401)  # what a registry says to an anonymous /v2/
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


@pytest.fixture
def http_registry() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []
    handler = type("Handler", (_Handler,), {"paths": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def no_files(path: str) -> bytes | None:
    return None


def test_any_http_answer_means_reachable(http_registry: tuple[str, list[str]]) -> None:
    url, seen = http_registry
    reg = registry(hosts=[{"url": url}, {"url": url + "/v2/mirror", "overridePath": True}])
    assert probe_registry(reg, no_files) is None
    assert seen == ["/v2/", "/v2/mirror"]


def test_an_unreachable_host_is_named(http_registry: tuple[str, list[str]]) -> None:
    url, _ = http_registry
    down = f"http://127.0.0.1:{closed_port()}"
    reason = probe_registry(registry(hosts=[{"url": url}, {"url": down}]), no_files)
    assert reason is not None
    assert reason.startswith(f"{down}/v2/: ")
    assert "refused" in reason.lower()


def test_a_missing_ca_file_is_a_failed_probe_naming_it() -> None:
    reg = RegistryConfig.model_validate(
        {"upstream": "r.local", "hosts": [{"url": "https://r.local", "caCerts": ["ca.crt"]}]}
    )
    reason = probe_registry(reg, no_files)
    assert reason is not None
    assert "/etc/containerd/certs.d/r.local/ca.crt" in reason


def test_probe_url() -> None:
    assert probe_url(RegistryHost(url="https://m:5000/")) == "https://m:5000/v2/"
    assert probe_url(RegistryHost(url="https://m/v2/x", override_path=True)) == "https://m/v2/x"
