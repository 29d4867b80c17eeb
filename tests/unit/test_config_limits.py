"""A config file cannot stop the agent: whatever its bytes or its kind of file, reading it ends
quickly, in bounded memory, with the config or a one-line ``ConfigError`` naming the file.

Upstream's verdicts on depth and aliases are in the shared table (tests/testbed/config_cases.py,
checked against upstream's binary); here: the Python stack, time, memory, special files, sizes,
values that would make an error message explode, and random YAML.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.base.configfile import MAX_CONFIG_BYTES, find_config, read_config_file
from node_agent.base.errors import ConfigError
from node_agent.base.goyaml import load_go_yaml
from node_agent.commands.status import offline_document
from node_agent.config import decode_config, load_config, parse_config
from tests.testbed.config_cases import (
    BILLION_LAUGHS,
    CASES,
    GARDENER_RENDERED,
    _block_depth,
    _flow_depth,
    _raw,
)

SOURCE = "/var/lib/gardener-node-agent/config-v1.150.0.yaml"


@contextlib.contextmanager
def _python_stack(frames: int) -> Iterator[None]:
    """At most ``frames`` Python frames more than the caller has."""
    depth = len(_frames())
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _frames() -> list[object]:
    frame, frames = sys._getframe(), []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back  # type: ignore[assignment]
    return frames


def _refusal(text: str) -> str:
    with pytest.raises(ConfigError) as refused:
        parse_config(text, source=SOURCE)
    message = str(refused.value)
    assert message.startswith(f"{SOURCE}: "), message
    assert "\n" not in message, message
    return message


# --- depth and aliases: no recursion, no explosion ------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("text", "accepted"),
    [
        (_flow_depth(1000), True),
        (_flow_depth(9999), True),
        (_block_depth(9999), True),
        (_flow_depth(10000), False),
        (_block_depth(10000), False),
    ],
    ids=["flow-1000", "flow-9999", "indent-9999", "flow-10000", "indent-10000"],
)
def test_any_depth_costs_no_python_stack(text: str, accepted: bool) -> None:
    # upstream accepts 10,000 levels; PyYAML's composer needs ~3 frames a level (RecursionError
    # at a few hundred): the document is built without recursion, in go-yaml's limits
    with _python_stack(60):
        if accepted:
            config = parse_config(text, source=SOURCE)
            assert config.controllers.operating_system_config.secret_name
            return
        with pytest.raises(ConfigError, match="exceeded max depth of 10000"):
            parse_config(text, source=SOURCE)


def test_an_unknown_field_1000_deep_is_accepted_as_upstream_does() -> None:
    parse_config(_flow_depth(1000), source=SOURCE)


@pytest.mark.timeout(60)
def test_a_billion_laughs_is_refused_at_once_as_upstream_does() -> None:
    start = time.monotonic()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    message = _refusal(BILLION_LAUGHS)
    assert "document contains excessive aliasing" in message
    assert time.monotonic() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 50 * 1024  # KiB


@pytest.mark.timeout(60)
def test_an_alias_inside_its_own_anchor_is_refused() -> None:
    message = _refusal(GARDENER_RENDERED + "x: &a [1, *a]\n")
    assert "anchor 'a' value contains itself" in message


def test_aliases_are_expanded_as_go_yaml_expands_them() -> None:
    doc = load_go_yaml("a: &a {x: [1, 2]}\nb: [*a, *a]\nc: {<<: *a, y: 3}\n")
    assert doc == {
        "a": {"x": [1, 2]},
        "b": [{"x": [1, 2]}, {"x": [1, 2]}],
        "c": {"x": [1, 2], "true": 3},  # y is go-yaml's true
    }
    doc["b"][0]["x"].append(9)  # a copy each, as Go decodes each alias again
    assert doc["a"]["x"] == [1, 2]
    assert doc["b"][1]["x"] == [1, 2]


@pytest.mark.parametrize(
    "value",
    ["!!bool maybe", "!!timestamp soon", '!!int ""', '!!float ""', "!!int _", "!!map ab"],
)
def test_an_explicit_tag_the_value_does_not_fit_is_a_config_error(value: str) -> None:
    # PyYAML's constructors raise KeyError, AttributeError or IndexError on these
    message = _refusal(GARDENER_RENDERED + f"x: {value}\n")
    assert "not valid YAML: line 23: " in message


# --- values that would make an error message explode -----------------------------------------

DEEP_LIST = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("kubernetesVersion: 1.33.0", f"kubernetesVersion: {DEEP_LIST}", "kubernetesVersion"),
        ("syncPeriod: 12h0m0s", f"syncPeriod: {DEEP_LIST}", "token.syncPeriod"),
        ("kind: NodeAgentConfiguration", f"kind: {DEEP_LIST}", "kind"),
        (
            "apiVersion: nodeagent.config.gardener.cloud/v1alpha1",
            f"apiVersion: v1\nx: &k {DEEP_LIST}\nkind: *k",
            "apiVersion",
        ),
        ('logLevel: ""', f"logLevel: {'x' * 100_000}", "logLevel"),
    ],
    ids=["version", "duration", "kind", "kind-after-api-version", "long-string"],
)
def test_a_refusal_shows_a_short_piece_of_the_value(old: str, new: str, field: str) -> None:
    message = _refusal(_raw(old, new))
    assert field in message
    assert len(message) < 400, message


def test_a_yaml_syntax_error_is_one_line_without_the_files_text() -> None:
    message = _refusal(GARDENER_RENDERED + "x: [1, 2\n" + "secret: hunter2\n")
    assert "not valid YAML: line " in message
    assert "hunter2" not in message


@pytest.mark.parametrize("case", [c for c in CASES if not c.accepted], ids=lambda c: c.name)
def test_every_refusal_of_the_table_is_one_line(case: object) -> None:
    assert not getattr(case, "accepted")  # noqa: B009 (the table's type is not imported here)
    _refusal(getattr(case, "text"))  # noqa: B009


# --- the file: only a regular file of a config's size -----------------------------------------


@pytest.mark.timeout(10)
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=rf"^config {fifo} is not a regular file \(a FIFO\)$"):
        load_config(fifo)


@pytest.mark.timeout(10)
def test_status_with_a_fifo_as_config_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    doc = offline_document(tmp_path, fifo, "not running")
    assert doc["osc"]["secret_name"] is None


@pytest.mark.timeout(10)
def test_a_fifo_in_the_config_dir_is_no_config(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "config-v1.151.0.yaml")
    os.mkfifo(tmp_path / "config.yaml")
    with pytest.raises(ConfigError, match=r"no config-<version>\.yaml or config\.yaml in"):
        find_config(tmp_path)
    (tmp_path / "config-v1.150.0.yaml").write_text(GARDENER_RENDERED)
    assert load_config(find_config(tmp_path)).kind == "NodeAgentConfiguration"


@pytest.mark.parametrize(
    ("path", "kind"), [("/dev/null", "a character device"), ("/", "a directory")]
)
def test_other_special_files_are_refused(path: str, kind: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config {path} is not a regular file \({kind}\)$"):
        load_config(Path(path), validate=False)


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "real.yaml").write_text(GARDENER_RENDERED)
    (tmp_path / "config.yaml").symlink_to(tmp_path / "real.yaml")
    assert load_config(tmp_path / "config.yaml").kind == "NodeAgentConfiguration"


def test_a_file_larger_than_a_config_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "config.yaml"
    big.write_text(GARDENER_RENDERED + "#" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match=rf"^config {big} is larger than 256 KiB"):
        load_config(big)
    exact = tmp_path / "exact.yaml"
    exact.write_bytes(GARDENER_RENDERED.encode().ljust(MAX_CONFIG_BYTES, b"\n"))
    assert read_config_file(exact) == exact.read_bytes()


def test_a_missing_config_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^cannot read config .*: No such file or directory$"):
        load_config(tmp_path / "missing.yaml")


# --- random YAML: only a ConfigError ever comes out -------------------------------------------

_YAML_PIECES = st.sampled_from(
    [
        *"[]{}:,-&*!<>#|'\"?%@`\n\t ~.0189aeyn_",
        *("&a ", "*a", "<<: ", "!!bool ", "!!int ", "!!map ", "!!binary ", "- ", ": ", "\n  "),
        *("--- ", "...", "\\0", "\x00", "\ufeff", "1e3", ".nan", "0x1F", "2001-12-14"),
    ]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(_YAML_PIECES, max_size=60).map("".join))
def test_random_yaml_gives_a_config_or_a_config_error(text: str) -> None:
    for doc in (text, GARDENER_RENDERED + text):
        try:
            decode_config(doc, source=SOURCE)
        except ConfigError as exc:
            message = str(exc)
        else:
            continue
        assert "\n" not in message
