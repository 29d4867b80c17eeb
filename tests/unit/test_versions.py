"""The one strict reader of version strings (``node_agent.base.versions``): ASCII digits only,
as Go's parsers read them, and nothing but ``VersionError`` for any text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.base import versions
from node_agent.base.versions import SemVer, VersionError


@pytest.mark.parametrize(
    ("text", "read"),
    [
        ("1", SemVer(1, 0, 0)),
        ("v1.33", SemVer(1, 33, 0)),
        ("1.33.4", SemVer(1, 33, 4)),
        ("01.002.3", SemVer(1, 2, 3)),  # Masterminds' lenient reading keeps leading zeros
        ("1.2.3-rc.1+build.5", SemVer(1, 2, 3, "rc.1", "build.5")),
        (str((1 << 64) - 1), SemVer((1 << 64) - 1, 0, 0)),
    ],
)
def test_what_is_read(text: str, read: SemVer) -> None:
    assert versions.semver(text) == read


@pytest.mark.parametrize(
    "text",
    [
        "", "v", "1.", ".1", "1..2", "1.2.3.4", " 1.2", "1.2 ", "1.3²", "1877.²", "1.٣٤",
        "\u0661.\u0662.\u0663", "1.2.3-", "1.2.3-01", "1.2.3-a..b", "1.2.3+", "1.2.3+a_b",
        str(1 << 64), "1" * 5000, "1.2.3-" + "a" * 300, "1\x00",
    ],
)  # fmt: skip
def test_what_is_refused(text: str) -> None:
    with pytest.raises(VersionError, match="not a semantic version"):
        versions.semver(text)


@given(st.text(max_size=40))
def test_any_text_is_read_or_refused_with_a_version_error(text: str) -> None:
    try:
        read = versions.semver(text)
    except VersionError:
        return
    assert text.isascii()
    assert versions.semver(read.text()) == read


@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1), st.integers(0, 99))
def test_numbers_round_trip(major: int, minor: int, patch: int) -> None:
    assert versions.semver(f"{major}.{minor}.{patch}") == SemVer(major, minor, patch)
    assert versions.semver(f"v{major}.{minor}").text() == f"{major}.{minor}.0"


def test_precedence_is_semvers() -> None:
    """Semantic Versioning 2.0.0, item 11: numbers numerically, a release after its
    prereleases, numeric identifiers before alphanumeric ones and numerically, more identifiers
    after fewer, build metadata ignored."""
    order = [
        "1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
        "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.2.0", "1.10.0", "2.0.0-0", "2.0.0",
    ]  # fmt: skip
    keys = [versions.precedence(versions.semver(text)) for text in order]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys)
    same = versions.precedence(versions.semver("1.0.0+build.1"))
    assert same == versions.precedence(versions.semver("v1.0+other"))


@given(
    st.from_regex(
        r"[0-9]{1,3}(\.[0-9]{1,3}){2}(-[0-9a-z]{1,3}(\.[0-9a-z]{1,3}){0,2})?", fullmatch=True
    )
)
def test_precedence_is_the_texts_own(text: str) -> None:
    try:
        read = versions.semver(text)
    except VersionError:
        return
    assert versions.precedence(read) == versions.precedence(versions.semver(read.text()))
