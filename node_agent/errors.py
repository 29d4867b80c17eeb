"""Typed errors for node-agent.

Callers branch on the error's class, not on its message: a bad OperatingSystemConfig is reported
and skipped until the Secret changes, whereas host, systemd and API failures are retried. Every
message names the file, unit or field at fault so an operator can act on the log line alone.
"""

from __future__ import annotations


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


class SystemdError(NodeAgentError):
    """A systemd operation (D-Bus call or job) failed."""


class KubeError(NodeAgentError):
    """A request to the Kubernetes API failed."""
