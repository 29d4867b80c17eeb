"""The one content digest the agent records and compares: SHA-256 in lower-case hex.

Why one place: the OSC's ``checksum/data-script``, the inventory's entries, the journal's claims
and the status document all compare digests with each other, so they must be spelt alike.
"""

from __future__ import annotations

import hashlib


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data``, lower-case hex (as the Secret's checksum annotation)."""
    return hashlib.sha256(data).hexdigest()
