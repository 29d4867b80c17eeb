"""Kubernetes answers → typed errors, shared by the client and the watch state machine.

Kept free of kubernetes-asyncio so that importing it (and :mod:`node_agent.kube.watch`) is cheap.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from node_agent.base.errors import (
    KubeAlreadyExists,
    KubeConflict,
    KubeForbidden,
    KubeGone,
    KubeInvalid,
    KubeNotFound,
    KubeServerError,
    KubeServerTimeout,
    KubeStatusError,
    KubeTooManyRequests,
    KubeUnauthorized,
    KubeUnavailable,
)


@dataclass(frozen=True)
class ObjectRef:
    """What a request is about, for error messages: ``get Secret kube-system/osc``."""

    verb: str
    kind: str
    namespace: str | None = None
    name: str | None = None

    def __str__(self) -> str:
        where = f"{self.namespace}/{self.name}" if self.namespace else (self.name or "")
        if not self.name:
            where = f"in {self.namespace}" if self.namespace else "(cluster)"
            return f"{self.verb} {self.kind}s {where}"
        return f"{self.verb} {self.kind} {where}"


def status_from_body(status: int, body: bytes, ref: ObjectRef) -> KubeStatusError:
    """The typed error for a non-2xx answer; only the server's Status message is quoted."""
    doc: Any = None
    with contextlib.suppress(ValueError):
        doc = json.loads(body)
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        return status_error(
            status, str(doc.get("reason") or ""), str(doc.get("message") or ""), ref
        )
    return status_error(status, "", "", ref)


def status_from_object(status_obj: object, ref: ObjectRef) -> KubeStatusError:
    """The typed error for a watch ``ERROR`` event (its object is a ``Status``)."""
    doc = status_obj if isinstance(status_obj, dict) else {}
    try:
        code = int(doc.get("code") or 500)
    except (TypeError, ValueError):
        code = 500
    return status_error(code, str(doc.get("reason") or ""), str(doc.get("message") or ""), ref)


def status_error(status: int, reason: str, message: str, ref: ObjectRef) -> KubeStatusError:
    """The typed error for an HTTP status (or a watch ERROR event's Status)."""
    cls: type[KubeStatusError]
    if status == 401:
        cls = KubeUnauthorized
    elif status == 403:
        cls = KubeForbidden
    elif status == 404:
        cls = KubeNotFound
    elif status == 409:
        cls = KubeAlreadyExists if reason == "AlreadyExists" else KubeConflict
    elif status == 410 or reason in ("Expired", "Gone"):
        cls = KubeGone
    elif status == 422:
        cls = KubeInvalid
    elif status == 429:
        cls = KubeTooManyRequests
    elif status == 503:
        cls = KubeUnavailable
    elif status == 504 or reason == "Timeout":
        cls = KubeServerTimeout
    elif status >= 500:
        cls = KubeServerError
    else:
        cls = KubeStatusError
    text = f"{ref}: {status} {reason or 'error'}"
    if message:
        text += f": {message}"
    return cls(
        text,
        status=status,
        reason=reason,
        verb=ref.verb,
        kind=ref.kind,
        namespace=ref.namespace,
        name=ref.name,
    )
