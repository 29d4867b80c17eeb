"""Registry mirrors: ``/etc/containerd/certs.d/<upstream>/hosts.toml`` per ``registries[]`` entry,
and the readiness probe of their hosts.

The text is byte for byte what upstream's template writes (its comment, optional ``server``, then
one ``[host."<url>"]`` table per host with ``capabilities``, ``ca`` and ``override_path``; lists
as Go's JSON, which is valid TOML): a node moved between the two agents keeps its files. containerd
reads these files on every pull, so a change needs no restart.
"""

from __future__ import annotations

import json
import posixpath
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable

from node_agent.base import layout
from node_agent.containerd.spec import Capability, RegistryConfig, RegistryHost

CERTS_DIR = layout.CONTAINERD_CERTS_DIR

HEADER = "# managed by gardener-node-agent"
# What a host may do when the OSC does not say (Gardener's default).
DEFAULT_CAPABILITIES: tuple[Capability, ...] = ("pull", "resolve")
# containerd's own capabilities of the ``server`` fallback.
SERVER_CAPABILITIES: tuple[Capability, ...] = ("pull", "resolve", "push")
PROBE_TIMEOUT = 1.0  # seconds per host, as upstream


def registry_dir(upstream: str) -> str:
    return posixpath.join(CERTS_DIR, upstream)


def hosts_toml_path(upstream: str) -> str:
    return posixpath.join(CERTS_DIR, upstream, "hosts.toml")


def ca_path(upstream: str, ca: str) -> str:
    """A relative ``caCerts`` entry is relative to the registry's directory (containerd's rule)."""
    return ca if posixpath.isabs(ca) else posixpath.join(registry_dir(upstream), ca)


def hosts_toml(registry: RegistryConfig) -> str | None:
    """The hosts.toml of ``registry``; None when it names neither a server nor a host.

    containerd 1.6 refuses a hosts.toml without any ``[host]`` table ("invalid `host` tree"),
    so a registry with a server and no hosts gets its server as the one host, with the
    capabilities containerd gives the server anyway: the same meaning, accepted by every version.
    """
    hosts = registry.hosts
    if not hosts:
        if registry.server is None:
            return None
        hosts = (RegistryHost(url=registry.server, capabilities=SERVER_CAPABILITIES),)
    text = HEADER + "\n"
    if registry.server is not None:
        text += f"server = {_quote(registry.server)}\n\n"
    for host in hosts:
        text += f"[host.{_quote(host.url)}]\n"
        text += f"  capabilities = {_json(list(host.capabilities or DEFAULT_CAPABILITIES))}\n"
        if host.ca_certs:
            text += f"  ca = {_json(list(host.ca_certs))}\n"
        if host.override_path:
            text += "  override_path = true\n"
        text += "\n"
    return text


def _quote(value: str) -> str:
    """The template's ``quote`` (Go's ``%q``) for a URL: a TOML basic string; DEL is escaped
    the TOML way (Go's ``\\x7f`` is no TOML escape)."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _json(value: object) -> str:
    """Go's ``json.Marshal`` (what the template's ``toJson`` and, for plain strings, ``quote``
    give): compact, non-ASCII kept, ``<``, ``>``, ``&``, U+2028 and U+2029 escaped; DEL too,
    which Go leaves as it is and TOML forbids, so that the value is always valid TOML."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    for char in "<>&\x7f\u2028\u2029":
        text = text.replace(char, f"\\u{ord(char):04x}")
    return text


def probe_url(host: RegistryHost) -> str:
    """Where a host is asked whether it is up: the registry API root ``/v2/``, or the URL
    itself when ``override_path`` says it already is the API endpoint."""
    if host.override_path:
        return host.url
    return host.url.rstrip("/") + "/v2/"


def probe_registry(
    registry: RegistryConfig,
    read: Callable[[str], bytes | None],
    *,
    timeout: float = PROBE_TIMEOUT,
) -> str | None:
    """Ask every host of ``registry`` once; None when all answered (any HTTP status counts: a
    registry answers 401 to an anonymous ``/v2/``), else why the first one did not.

    ``read`` gives the bytes of a host file (the CA files, read through the agent's root)."""
    for host in registry.hosts:
        url = probe_url(host)
        try:
            context = _tls_context(registry.upstream, host, read)
            request = urllib.request.Request(url, method="GET")
            with urllib.request.urlopen(request, timeout=timeout, context=context):
                pass
        except urllib.error.HTTPError:
            continue  # an answer: the host is up
        except (OSError, ValueError, ssl.SSLError) as exc:
            reason = getattr(exc, "reason", exc)
            return f"{url}: {' '.join(str(reason).split())}"
    return None


def _tls_context(
    upstream: str, host: RegistryHost, read: Callable[[str], bytes | None]
) -> ssl.SSLContext | None:
    if not host.url.startswith("https://"):
        return None
    if not host.ca_certs:
        return ssl.create_default_context()
    pems: list[str] = []
    for ca in host.ca_certs:
        path = ca_path(upstream, ca)
        data = read(path)
        if data is None:
            raise FileNotFoundError(f"CA file {path} is missing")
        pems.append(data.decode("ascii", errors="replace"))
    return ssl.create_default_context(cadata="\n".join(pems))
