"""Text that goes somewhere with a size limit (a Node annotation, an Event's message), or to a
terminal.

Cut in the middle, not at the end: the head names what failed and the tail carries a command's
last words, and both matter more than what lies between them. What goes to a terminal has its
control characters escaped: it comes from units' output, the OSC and the API server.
"""

from __future__ import annotations

import re
import unicodedata

REDACTED = "[redacted]"
#: What looks like a credential wherever it stands (a log value, a stored error): a service
#: account token (JWT), a bootstrap token ``id.secret``, a bearer header, a private key.
SECRET_VALUES = re.compile(
    r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|[a-z0-9]{6}\.[a-z0-9]{16}"
    r"|Bearer\s+\S+"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)


def scrub(text: str) -> str:
    """``text`` with whatever looks like a credential replaced by ``[redacted]``."""
    return SECRET_VALUES.sub(REDACTED, text)


def head_and_tail(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes: its head and its tail, saying how many bytes were
    cut between them. Always valid UTF-8 (it is persisted and sent as JSON)."""
    raw = text.encode(errors="replace")
    if len(raw) <= limit:
        return raw.decode()
    head_size = limit // 4
    tail_size = limit - head_size - 64  # room for the note
    cut = len(raw) - head_size - tail_size
    head = raw[:head_size].decode(errors="ignore")
    tail = raw[-tail_size:].decode(errors="ignore")
    return f"{head} [... {cut} bytes cut ...] {tail}"


def escape_controls(line: str) -> str:
    """``line`` with control and format characters (ESC, CR, BEL, NUL, C1 controls, bidi
    overrides) written as ``\\xNN``/``\\uNNNN``: stored errors and unit names come from units'
    output and the OSC, and must not drive the terminal that shows them."""
    if all(unicodedata.category(ch) not in ("Cc", "Cf") for ch in line):
        return line
    return "".join(
        ch if unicodedata.category(ch) not in ("Cc", "Cf") else ascii(ch)[1:-1] for ch in line
    )
