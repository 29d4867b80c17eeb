"""Version strings read the way Gardener's Go programs read them: one strict reader.

Gardener reads versions with Masterminds' semver (``NewVersion``, which coerces ``1`` and
``v1.33`` to ``1.0.0`` and ``1.33.0``). Go's regular expressions and ``strconv`` take ASCII digits
only, whereas Python's ``str.isdigit`` also accepts ``²`` (which ``int`` then refuses) and
``int`` reads ``٣٤`` as 34: a version checked or converted with those would crash on the first
or be read as another version on the second. Every version the agent compares goes through
:func:`semver`, which raises :class:`VersionError` (a ``ValueError``) and nothing else.
"""

from __future__ import annotations

import re
from typing import NamedTuple

#: Masterminds' lenient grammar (its ``NewVersion`` with coercion, the default); ``[0-9]`` is
#: ASCII, as in Go
_SEMVER = re.compile(
    r"v?([0-9]+)(?:\.([0-9]+))?(?:\.([0-9]+))?"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)
#: the longest text read at all (no version comes near it; a longer one is not parsed)
MAX_LENGTH = 256
#: each number is a uint64 (``strconv.ParseUint(s, 10, 64)``)
_UINT64 = 1 << 64


class VersionError(ValueError):
    """The text is not a version; the message quotes it (shortened)."""


class SemVer(NamedTuple):
    major: int
    minor: int
    patch: int
    prerelease: str = ""
    metadata: str = ""

    def text(self) -> str:
        """As Masterminds prints it (``v1.33`` is ``1.33.0``)."""
        pre = f"-{self.prerelease}" if self.prerelease else ""
        meta = f"+{self.metadata}" if self.metadata else ""
        return f"{self.major}.{self.minor}.{self.patch}{pre}{meta}"


def semver(text: str) -> SemVer:
    """``text`` read as ``semver.NewVersion`` reads it: one to three numbers of ASCII digits
    (missing ones are 0), each below 2^64, then an optional prerelease whose numeric parts have
    no leading zero, and optional build metadata."""
    match = _SEMVER.fullmatch(text) if len(text) <= MAX_LENGTH else None
    if match is None:
        raise VersionError(f"not a semantic version: {shown(text)}")
    major, minor, patch, pre, meta = match.groups()
    numbers = [int(part or "0") for part in (major, minor, patch)]  # at most 256 digits each
    if any(n >= _UINT64 for n in numbers):
        raise VersionError(f"not a semantic version: {shown(text)} (a number is too large)")
    for part in pre.split(".") if pre else ():
        if len(part) > 1 and part.startswith("0") and part.isdigit():
            raise VersionError(f"not a semantic version: {shown(text)} (prerelease {part!r})")
    return SemVer(numbers[0], numbers[1], numbers[2], pre or "", meta or "")


#: a prerelease identifier's place in :func:`precedence`: (0, number, "") or (1, 0, text)
_Identifier = tuple[int, int, str]


def precedence(version: SemVer) -> tuple[int, int, int, int, tuple[_Identifier, ...]]:
    """Sort key of ``version`` by Semantic Versioning precedence: the numbers numerically, a
    release after all of its prereleases, a prerelease's numeric identifiers numerically and
    before alphanumeric ones, more identifiers after fewer; build metadata does not count."""
    if not version.prerelease:
        return (version.major, version.minor, version.patch, 1, ())
    parts = tuple(
        (0, int(p), "") if p.isascii() and p.isdigit() else (1, 0, p)
        for p in version.prerelease.split(".")
    )
    return (version.major, version.minor, version.patch, 0, parts)


def shown(text: str, limit: int = 80) -> str:
    """``text`` quoted for a message, shortened: a version may come from a 1 MiB field."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
