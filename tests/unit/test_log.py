"""Logs are JSON lines, carry journald priorities, and never contain secrets."""

from __future__ import annotations

import io
import json

import pytest

from node_agent.base import log
from node_agent.base.text import REDACTED


def _emit(monkeypatch: pytest.MonkeyPatch, journal: bool, **fields: object) -> str:
    stream = io.StringIO()
    if journal:
        monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
    else:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    log.configure("debug", "json", stream=stream)
    logger = log.get_logger("test")
    logger.warning("something happened", **fields)
    return stream.getvalue()


def test_one_json_object_per_line(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _emit(monkeypatch, journal=False, unit="kubelet.service")
    lines = out.splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["event"] == "something happened"
    assert event["level"] == "warning"
    assert event["unit"] == "kubelet.service"
    assert event["timestamp"].endswith("Z")


def test_secrets_are_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2lnbmF0dXJlc2lnbmF0dXJl"
    out = _emit(
        monkeypatch,
        journal=False,
        token="plain-token-value",
        secret={"data": {"token": "abc"}, "name": "kube-system/x"},
        message=f"request failed with Authorization: Bearer {jwt}",
        raw_bytes=b"\x00secret",
        bootstrap="abcdef.0123456789abcdef",
    )
    assert "plain-token-value" not in out
    assert jwt not in out
    assert "abcdef.0123456789abcdef" not in out
    assert "secret\\u0000" not in out
    event = json.loads(out)
    assert event["token"] == REDACTED
    assert event["secret"] == {"data": REDACTED, "name": "kube-system/x"}
    assert event["raw_bytes"] == "<7 bytes>"


def test_journald_priority_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    # A stream given explicitly is not the journal: no prefix.
    assert _emit(monkeypatch, journal=True).startswith("{")
    renderer = log._JournalRenderer(prefix=True)
    assert renderer(None, "error", {"event": "x", "level": "error"}).startswith("<3>{")
    assert renderer(None, "info", {"event": "x", "level": "info"}).startswith("<6>{")
    assert renderer(None, "warning", {"event": "x", "level": "warning"}).startswith("<4>{")


def test_standard_library_loggers_are_json_and_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    stream = io.StringIO()
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    log.configure("info", "json", stream=stream)
    logging.getLogger("node_agent.kube.watch").warning(
        "watch failed with Bearer %s", "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"
    )
    logging.getLogger("kubernetes_asyncio.client.rest").debug("response body: secret")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["level"] == "warning"
    assert event["logger"] == "node_agent.kube.watch"
    assert "eyJ" not in event["event"]


def test_python_warnings_are_json_lines_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library's UserWarning would be plain text on stderr, in a journal that is otherwise
    JSON: it goes through the same handler."""
    import logging
    import warnings

    stream = io.StringIO()
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    logging.captureWarnings(False)  # an earlier configure() in this process took it over
    with warnings.catch_warnings():
        try:
            log.configure("info", "json", stream=stream)
            warnings.simplefilter("always")
            warnings.warn("Attribute's length must be >= 1 and <= 64", UserWarning, stacklevel=1)
        finally:
            logging.captureWarnings(False)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert event["level"] == "warning"
    assert event["logger"] == "py.warnings"
    assert "Attribute's length" in event["event"]
