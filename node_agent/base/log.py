"""Structured logging: one JSON object per line, journald priorities, and no secrets ever.

Under systemd, stdout goes to the journal and a leading ``<N>`` on a line sets its priority
(``SyslogLevelPrefix=`` is on by default), so warnings and errors stay filterable with
``journalctl -p``. Redaction runs last, on every event, so a careless call site cannot leak a
token or Secret data into the log.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

from node_agent.base.text import REDACTED, scrub

# Keys whose values are never logged, whatever their type.
_SECRET_KEYS = re.compile(
    r"(^|_)(token|password|secret_data|data|content|authorization|bearer|key_data|"
    r"client_key|private_key|osc_bytes|raw)$",
    re.IGNORECASE,
)
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2, "exception": 3}
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _scrub(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, Mapping):
        return {k: REDACTED if _SECRET_KEYS.search(str(k)) else _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


def redact(
    _logger: object, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """structlog processor: blank secret-looking keys and values, recursively."""
    for key in list(event):
        if key in ("event", "level", "timestamp", "logger"):
            if isinstance(event[key], str):
                event[key] = scrub(event[key])
            continue
        event[key] = REDACTED if _SECRET_KEYS.search(key) else _scrub(event[key])
    return event


class _JournalRenderer:
    """Render JSON, prefixed with ``<priority>`` when stdout is the journal."""

    def __init__(self, prefix: bool) -> None:
        self._json = structlog.processors.JSONRenderer(sort_keys=False)
        self._prefix = prefix

    def __call__(self, logger: object, method: str, event: MutableMapping[str, Any]) -> str:
        line = str(self._json(logger, method, event))
        if self._prefix:
            return f"<{_PRIORITY.get(str(event.get('level', 'info')), 6)}>{line}"
        return line


def configure(level: str = "info", fmt: str = "json", stream: TextIO | None = None) -> None:
    """Set up structlog once per process. ``fmt`` is ``json`` (default) or ``text``."""
    out = stream if stream is not None else sys.stdout
    journal = "JOURNAL_STREAM" in os.environ and stream is None
    renderer: Any = (
        _JournalRenderer(prefix=journal)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    shared: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        redact,
    ]
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, *shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            _LEVELS.get(level.lower(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # Standard-library loggers (node_agent.kube, aiohttp, ...) go through the same renderer and
    # redaction, so every line of the agent is one JSON object.
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS.get(level.lower(), logging.INFO))
    # Python's warnings (a library's UserWarning) would go to stderr as plain text, into a
    # journal that is otherwise JSON: through the same handler instead (logger "py.warnings").
    logging.captureWarnings(True)
    # Library loggers may log request bodies at DEBUG: never below WARNING.
    for noisy in ("kubernetes_asyncio", "aiohttp", "urllib3", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str | None = None, **context: Any) -> Any:
    logger = structlog.get_logger(name)
    return logger.bind(**context) if context else logger
