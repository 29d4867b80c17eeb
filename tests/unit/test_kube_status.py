"""HTTP status / watch ERROR Status → typed KubeError, with messages that name the object."""

from __future__ import annotations

import json

import pytest

from node_agent.base.errors import (
    KubeAlreadyExists,
    KubeConflict,
    KubeError,
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
from node_agent.kube.api_errors import ObjectRef, status_error, status_from_body, status_from_object

REF = ObjectRef("get", "Secret", "kube-system", "osc")


@pytest.mark.parametrize(
    ("status", "reason", "cls"),
    [
        (401, "Unauthorized", KubeUnauthorized),
        (403, "Forbidden", KubeForbidden),
        (404, "NotFound", KubeNotFound),
        (409, "Conflict", KubeConflict),
        (409, "AlreadyExists", KubeAlreadyExists),
        (410, "Expired", KubeGone),
        (410, "Gone", KubeGone),
        (422, "Invalid", KubeInvalid),
        (429, "TooManyRequests", KubeTooManyRequests),
        (500, "InternalError", KubeServerError),
        (503, "ServiceUnavailable", KubeUnavailable),
        (504, "Timeout", KubeServerTimeout),
        (500, "Timeout", KubeServerTimeout),
        (400, "BadRequest", KubeStatusError),
    ],
)
def test_status_maps_to_typed_error(status: int, reason: str, cls: type[KubeError]) -> None:
    err = status_error(status, reason, "details", REF)
    assert type(err) is cls
    assert isinstance(err, KubeStatusError)
    assert err.status == status
    assert (err.verb, err.kind, err.namespace, err.name) == ("get", "Secret", "kube-system", "osc")
    assert str(err) == f"get Secret kube-system/osc: {status} {reason}: details"


def test_already_exists_is_a_conflict() -> None:
    assert issubclass(KubeAlreadyExists, KubeConflict)
    assert issubclass(KubeUnavailable, KubeServerError)


def test_body_status_message_is_quoted_but_nothing_else() -> None:
    body = json.dumps(
        {
            "kind": "Status",
            "status": "Failure",
            "reason": "NotFound",
            "message": 'secrets "osc" not found',
            "code": 404,
        }
    ).encode()
    err = status_from_body(404, body, REF)
    assert isinstance(err, KubeNotFound)
    assert str(err) == 'get Secret kube-system/osc: 404 NotFound: secrets "osc" not found'

    # A non-Status body (could be anything, even secret data) is never echoed.
    err = status_from_body(500, b'{"data": {"token": "c2VjcmV0"}}', REF)
    assert str(err) == "get Secret kube-system/osc: 500 error"
    assert "c2VjcmV0" not in str(err)
    assert str(status_from_body(502, b"<html>bad gateway</html>", REF)).endswith("502 error")


def test_watch_error_event_status() -> None:
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
    err = status_from_object(status, ObjectRef("watch", "Secret", "kube-system", "osc"))
    assert isinstance(err, KubeGone)
    assert str(err) == "watch Secret kube-system/osc: 410 Expired: too old"
    assert isinstance(status_from_object(None, REF), KubeServerError)
    assert isinstance(status_from_object({"code": "bogus"}, REF), KubeServerError)


@pytest.mark.parametrize(
    ("ref", "text"),
    [
        (ObjectRef("get", "Node", None, "n1"), "get Node n1"),
        (ObjectRef("list", "Secret", "kube-system"), "list Secrets in kube-system"),
        (ObjectRef("list", "Node"), "list Nodes (cluster)"),
        (ObjectRef("patch", "Lease", "kube-system", "l"), "patch Lease kube-system/l"),
    ],
)
def test_object_ref_text(ref: ObjectRef, text: str) -> None:
    assert str(ref) == text
