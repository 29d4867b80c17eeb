"""Text that goes somewhere with a size limit (a Node annotation, an Event's message).

Cut in the middle, not at the end: the head names what failed and the tail carries a command's
last words, and both matter more than what lies between them.
"""

from __future__ import annotations


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
