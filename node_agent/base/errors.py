"""Typed errors for node-agent.

Callers branch on the error's class, not on its message: a bad OperatingSystemConfig is reported
and skipped until the Secret changes, whereas host, systemd and API failures are retried. Every
message names the file, unit or field at fault so an operator can act on the log line alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from node_agent.base.layout import CONTAINERD_CONFIG_FILE


class NodeAgentError(Exception):
    """Base class of every error node-agent raises on purpose."""


class ConfigError(NodeAgentError):
    """The agent's own configuration (NodeAgentConfiguration, flags) is unusable."""


# --- bad OperatingSystemConfig input -------------------------------------------------------------


class OSCError(NodeAgentError):
    """The OperatingSystemConfig is unusable; retrying with the same input cannot help."""


class OSCDecodeError(OSCError):
    """The osc.yaml bytes could not be read as an OperatingSystemConfig at all.

    Raised for malformed YAML/JSON, a wrong apiVersion or kind, or input over the size limit.
    """


class OSCChecksumError(OSCError):
    """The osc.yaml bytes do not match the sha256 in the Secret's checksum annotation."""

    def __init__(self, message: str, *, expected: str | None, actual: str) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class OSCValidationError(OSCError):
    """A field of a decoded OperatingSystemConfig has a value node-agent refuses to apply.

    ``field`` is a dotted location such as ``spec.files[3].path``; ``item`` names the file path,
    unit or drop-in involved when one is known.
    """

    def __init__(self, message: str, *, field: str | None = None, item: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.item = item


class SecretRefError(OSCError):
    """A file's ``content.secretRef`` could not be resolved to bytes."""

    def __init__(
        self, secret_name: str, data_key: str, *, path: str | None = None, reason: str
    ) -> None:
        where = f" for file {path}" if path else ""
        super().__init__(f"secret kube-system/{secret_name} key {data_key!r}{where}: {reason}")
        self.secret_name = secret_name
        self.data_key = data_key
        self.path = path
        self.reason = reason


# --- other layers (placeholders, refined by their owners) ----------------------------------------


class HostError(NodeAgentError):
    """Reading or changing the host's file system failed."""


class UnsafePathError(HostError):
    """A host path was refused before any I/O: relative, ``..``, NUL, or through a symlink.

    Never retried blindly: a symlink planted in a parent directory would redirect a write outside
    the intended tree, so an operator has to look at ``path``.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"refusing host path {path!r}: {reason}")
        self.path = path
        self.reason = reason


class HostIOError(HostError):
    """A system call on a host path failed; ``op`` names it, ``errno`` is the OS error number."""

    def __init__(self, op: str, path: str, cause: OSError) -> None:
        super().__init__(f"{op} {path}: {cause.strerror or cause}")
        self.op = op
        self.path = path
        self.errno = cause.errno


class ContainerdConfigError(HostError):
    """containerd's config.toml on the host cannot be patched (not TOML, unknown version, a
    table where the file has a plain value)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{CONTAINERD_CONFIG_FILE}: {reason}")
        self.reason = reason


class SystemdError(NodeAgentError):
    """A systemd operation (D-Bus call or job) failed."""


class SystemdUnavailable(SystemdError):
    """The systemd worker could not be started or could not reach systemd over D-Bus."""


class SystemdTimeout(SystemdError):
    """A systemd call did not answer within its deadline; the worker was killed (and respawns)."""

    def __init__(self, message: str, *, op: str, timeout: float) -> None:
        super().__init__(message)
        self.op = op
        self.timeout = timeout


class SystemdWorkerDied(SystemdError):
    """The systemd worker process exited or was killed while a call was in flight."""


class SystemdCallError(SystemdError):
    """systemd answered a call with a D-Bus error; ``name`` is the D-Bus error name."""

    def __init__(
        self, message: str, *, op: str, name: str = "", errno: int = 0, units: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.op = op
        self.name = name
        self.errno = errno
        self.units = units


class KubeError(NodeAgentError):
    """A request to the Kubernetes API failed."""


class KubeConfigError(KubeError):
    """The kubeconfig, CA or token file cannot be used to build a client (missing, malformed)."""


class KubeTransportError(KubeError):
    """No complete HTTP answer: connection refused or reset, TLS failure, or a broken stream.

    Transient by nature; callers retry with backoff.
    """


class KubeTimeout(KubeTransportError):
    """The request did not complete within its timeout (e.g. a hung or frozen API server)."""


class KubeStatusError(KubeError):
    """The API server answered with a non-2xx status.

    ``verb``, ``kind``, ``namespace`` and ``name`` name the request; ``reason`` is the
    ``Status.reason`` from the answer (e.g. ``NotFound``, ``AlreadyExists``, ``Expired``).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int,
        reason: str = "",
        verb: str = "",
        kind: str = "",
        namespace: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.verb = verb
        self.kind = kind
        self.namespace = namespace
        self.name = name


class KubeUnauthorized(KubeStatusError):
    """401: the bearer token was rejected (even after re-reading the token file once)."""


class KubeForbidden(KubeStatusError):
    """403: RBAC does not allow this request for the agent's identity."""


class KubeNotFound(KubeStatusError):
    """404: the named object does not exist."""


class KubeConflict(KubeStatusError):
    """409: the object changed since it was read (stale resourceVersion); re-read and retry."""


class KubeAlreadyExists(KubeConflict):
    """409 with reason ``AlreadyExists``: a create found the object already there."""


class KubeGone(KubeStatusError):
    """410: the resourceVersion is too old (compacted); a watch must re-list."""


class KubeInvalid(KubeStatusError):
    """422: the server rejected the object as invalid; retrying the same body cannot help."""


class KubeTooManyRequests(KubeStatusError):
    """429: throttled by API priority and fairness; retry later."""


class KubeServerError(KubeStatusError):
    """5xx: the API server (or etcd behind it) failed; transient, retry with backoff."""


class KubeUnavailable(KubeServerError):
    """503: the API server is not ready or is shutting down."""


class KubeServerTimeout(KubeServerError):
    """504, or a Status with reason ``Timeout``: the server gave up on the request."""


class CertificateError(KubeError):
    """The agent's client certificate could not be obtained or used: the request was denied or
    not issued in time, the certificate or key is unreadable, no credentials are left to ask
    with. The message names the CertificateSigningRequest or the file."""


class ImageError(NodeAgentError):
    """A file could not be taken from a container image: the pull failed (unknown image,
    registry unreachable, auth), or the path is not a regular file in the image. Retried
    with the next apply attempt; the message names the image."""

    def __init__(self, image: str, reason: str) -> None:
        super().__init__(f"image {image}: {reason}")
        self.image = image
        self.reason = reason


class ApplyError(NodeAgentError):
    """Applying a change set did not fully succeed (e.g. a unit failed to restart).

    ``report`` is the executor's account of what was done before the failure.
    """

    def __init__(self, message: str, *, report: object = None) -> None:
        super().__init__(message)
        self.report = report


class ResetBusyError(NodeAgentError):
    """Another ``node-agent reset`` held the node's reset lock for longer than we wait."""


class ResetIncompleteError(NodeAgentError):
    """``reset`` did all it could and these items are still on the node; ``items`` names each
    (a path or a unit) with why. Raised at the very end, after the credentials are gone."""

    def __init__(self, items: Sequence[tuple[str, str]]) -> None:
        names = ", ".join(item for item, _ in items)
        super().__init__(
            f"reset incomplete: {len(items)} item(s) not removed ({names}); everything else "
            "was done; run reset again once they are fixed"
        )
        self.items = tuple(items)


class InPlaceUpdateError(NodeAgentError):
    """A step of an in-place update (OS update command, kubelet health afterwards, credentials
    rotation) failed. ``terminal``: retrying the same OSC cannot help (a non-retriable OS
    update error, an OS that came back on its old version); the Node carries the outcome and
    the agent waits for the Secret to change. Otherwise the reconcile is retried."""

    def __init__(self, message: str, *, terminal: bool = False) -> None:
        super().__init__(message)
        self.terminal = terminal


class UnexpectedError(NodeAgentError):
    """An error of a kind no layer expected (a bug, or input no check foresaw), caught where a
    controller works on one item: ``item`` names it, ``cause`` is what was raised. Reported and
    retried like any failed reconcile; it never ends the agent."""

    def __init__(self, item: str, cause: BaseException) -> None:
        text = str(cause)
        if len(text) > 300:  # the message may quote a whole input
            text = f"{text[:300]}... ({len(text)} characters)"
        super().__init__(
            f"{item}: {type(cause).__name__}: {text}" if text else f"{item}: {type(cause).__name__}"
        )
        self.item = item
        self.cause = cause
