"""Fuzz: the bytes of an OSC Secret through the pure path, end to end.

decode (``osc.decode.decode_osc``) → the containerd files a criConfig asks for (the applier's
``ContainerdExpander``) → plan (``osc.plan.plan``, from the OSC applied before) →
in-place detection (``osc.inplace.plan``/``detect``, against an os-release) → steps
(``osc.steps.step_ids``, the inventory claims of ``host.state.write_claims``, the change set's
JSON and YAML) → what is reported (the Node patches and Events of ``kube.report`` and
``osc.inplace``). Each stage lets through only the errors ``tests/fuzz/harness.py`` lists for
it, within the per-example bound on time and memory.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node_agent.containerd.expand import ContainerdExpander
from node_agent.host.fs import HostFS
from node_agent.host.state import write_claims
from node_agent.kube import report
from node_agent.osc import inplace as ip
from node_agent.osc.decode import decode_osc
from node_agent.osc.merge import osc_files
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import ChangeSet, plan
from node_agent.osc.steps import step_ids
from tests.fuzz import harness
from tests.fuzz.harness import bounded, budget, expect, only
from tests.fuzz.strategies import (
    HOST,
    applied_docs,
    bombed_kubelet_config,
    checksum,
    config_toml_bases,
    os_releases,
    osc_bytes,
    osc_docs,
)
from tests.unit.test_inplace import osc_doc

#: a failure takes minutes to shrink; a pass takes seconds
pytestmark = pytest.mark.timeout(900)

#: the longest error text a refusal may carry: it becomes a Node annotation or Event message
MAX_ERROR_TEXT = 16 * 1024


def _raw(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _deep_kubelet(depth: int) -> dict[str, Any]:
    doc = osc_doc(os_version="1877.5")
    doc["spec"]["files"][0]["content"]["inline"] = {"data": "[" * depth + "]" * depth}
    return doc


def _in_place(**kw: Any) -> bytes:
    return _raw(osc_doc(**kw))


#: the inputs issue 33 named (finding 1), run first in every short run
def _bombed(levels: int, width: int) -> bytes:
    doc = osc_doc(os_version="1877.5")
    text = bombed_kubelet_config(levels, width, "memory.available")
    doc["spec"]["files"][0]["content"]["inline"] = {"data": text}
    return _raw(doc)


KNOWN: tuple[tuple[bytes | None, bytes, str | None], ...] = (
    (_in_place(), _in_place(kubelet="1.3²"), 'PRETTY_NAME="Garden Linux 1877.4"\n'),
    (_in_place(), _in_place(os_version="1877.²"), 'PRETTY_NAME="Garden Linux 1877.4"\n'),
    (_in_place(), _in_place(kubelet="1.٣٤"), 'PRETTY_NAME="Garden Linux 1877.4"\n'),
    (_in_place(), _raw(_deep_kubelet(3000)), 'PRETTY_NAME="Garden Linux 1877.4"\n'),
    # found by this harness: a version number of 5,000 digits (int() refuses over 4,300), an
    # eviction threshold that is a billion-laughs value
    (_in_place(), _in_place(kubelet="1." + "9" * 5000), 'PRETTY_NAME="Garden Linux 1877.4"\n'),
    (_in_place(), _bombed(7, 12), 'PRETTY_NAME="Garden Linux 1877.4"\n'),
)


def decoded(raw: bytes, where: str) -> OperatingSystemConfig | None:
    """The OSC of ``raw`` as the controller decodes it, or None when refused (typed)."""
    osc: OperatingSystemConfig | None = None
    with only(harness.DECODE_OSC, where) as outcome:
        osc = decode_osc(raw, checksum(raw), HOST)
    if outcome.refused is not None:
        _bounded_text(outcome.refused, where)
        return None
    return osc


def _bounded_text(exc: BaseException, where: str) -> None:
    text = str(exc)
    expect(
        len(text.encode("utf-8", "replace")) <= MAX_ERROR_TEXT,
        where,
        lambda: f"error text over {MAX_ERROR_TEXT} bytes ({len(text)} characters): {text[:200]!r}",
    )


def _foreign_digits(version: str) -> bool:
    return any(not ch.isascii() and unicodedata.digit(ch, None) is not None for ch in version)


def _misread_versions(
    old: OperatingSystemConfig, new: OperatingSystemConfig, current: str | None
) -> list[str]:
    """The versions ``detect`` compared (the kubelet's when they differ, the OS's against the
    host's) that hold a digit Python takes for a number and Go does not."""
    old_spec, new_spec = old.spec.in_place_updates, new.spec.in_place_updates
    if old_spec is None or new_spec is None:
        return []
    compared = [new_spec.operating_system_version, current or ""]
    if old_spec.kubelet_version != new_spec.kubelet_version:
        compared += [old_spec.kubelet_version, new_spec.kubelet_version]
    return [v for v in compared if _foreign_digits(v)]


def _secrets(osc: OperatingSystemConfig | None) -> dict[str, bytes]:
    if osc is None:
        return {}
    return {f.path: b"secret\n" for f in osc_files(osc, HOST) if f.content.secret_ref is not None}


def expanded(
    osc: OperatingSystemConfig | None, expand: ContainerdExpander | None, where: str
) -> OperatingSystemConfig | None:
    """``osc`` with the containerd files its criConfig asks for (the applier's expansion)."""
    if osc is None or expand is None:
        return osc
    out: OperatingSystemConfig | None = None
    with only(harness.EXPAND, where) as outcome:
        out = expand(osc)
    return None if outcome.refused is not None else out


def pipeline(
    old_raw: bytes | None,
    new_raw: bytes,
    os_release: str | None,
    expand: ContainerdExpander | None = None,
) -> None:
    old = decoded(old_raw, "decode_osc (applied)") if old_raw is not None else None
    new = decoded(new_raw, "decode_osc")
    old, new = (
        expanded(old, expand, "containerd expansion (applied)"),
        expanded(new, expand, "containerd expansion"),
    )
    if new is None:
        return
    with only(harness.PLAN, "plan → steps"):
        cs = plan(old, new, HOST, _secrets(new), previous_resolved=_secrets(old))
        steps = step_ids(cs)
        expect(len(set(steps)) == len(steps), "steps", lambda: f"a step twice: {steps}")
        claims = write_claims(cs)
        expect(set(claims) <= set(steps), "claims", lambda: f"{set(claims) - set(steps)}")
        cs.summary()
        cs.reasons()
        again = ChangeSet.from_json(cs.to_json())
        expect(again == cs, "change set JSON", lambda: "does not read back as written")
        expect(ChangeSet.from_yaml(cs.to_yaml()) == cs, "change set YAML", lambda: "differs")
    with only(harness.INPLACE_PLAN, "inplace.plan"):
        found = ip.plan(old, new, os_release)
        if found is not None:
            ip.describe(found)
    current: str | None = None
    with only(harness.DETECT, "inplace.os_version") as outcome:
        current = ip.os_version(os_release) if os_release is not None else None
    reasons: list[str] = []
    if old is not None and outcome.refused is None:
        with only(harness.DETECT, "inplace.detect") as detected:
            changes = ip.detect(old, new, current)
            changes.names()
        if detected.refused is not None:
            _bounded_text(detected.refused, "inplace.detect")
            reasons.append(str(detected.refused))
        else:
            misread = _misread_versions(old, new, current)
            expect(
                not misread,
                "inplace.detect (versions)",
                lambda: (
                    f"took {misread} for numbers; Go's semver refuses a digit that is not "
                    "ASCII (issue 33, finding 1)"
                ),
            )
    spec = new.spec.in_place_updates
    with only(harness.PLAN, "report patches"):
        patches = [
            report.applied_patch(
                checksum=checksum(new_raw),
                kubernetes_version=spec.kubelet_version if spec is not None else None,
                control_plane=False,
                zone=None,
            ),
            ip.successful_patch(),
            *(ip.failed_patch(reason) for reason in reasons),
        ]
        if spec is not None:
            patches.append(ip.updating_os_patch(spec.operating_system_version))
        for reason in reasons:
            patches.append(
                report.node_event(node_name=HOST, node_uid=None, reason="x", message=reason)
            )
        for patch in patches:
            json.dumps(patch)


_applied = st.one_of(
    st.none(), applied_docs().flatmap(osc_bytes), applied_docs().flatmap(osc_bytes)
)


@pytest.fixture(scope="module")
def empty_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node with nothing on it: the containerd expansion reads config.toml from there."""
    return tmp_path_factory.mktemp("fuzz-osc")


@budget(short=100)
@given(
    old_raw=_applied,
    new_raw=osc_docs().flatmap(osc_bytes),
    os_release=os_releases(),
    config_toml=config_toml_bases,
)
def test_an_osc_goes_the_pure_path_or_is_refused_typed(
    empty_root: Path,
    old_raw: bytes | None,
    new_raw: bytes,
    os_release: str | None,
    config_toml: str,
) -> None:
    harness.example((old_raw, new_raw, os_release))
    expand = ContainerdExpander(
        HostFS(empty_root),
        default_config=lambda: config_toml.encode(),
        probe=lambda registry, read: None,
    )
    with bounded("osc pipeline"):
        pipeline(old_raw, new_raw, os_release, expand)


@pytest.mark.parametrize(
    ("old_raw", "new_raw", "os_release"),
    KNOWN,
    ids=[
        "kubelet-1.3-superscript-two",
        "os-1877-superscript-two",
        "kubelet-arabic-indic-minor",
        "kubelet-config-3000-deep",
        "kubelet-minor-5000-digits",
        "eviction-threshold-billion-laughs",
    ],
)
def test_an_input_known_to_break_the_path_is_refused_typed(
    old_raw: bytes | None, new_raw: bytes, os_release: str | None
) -> None:
    """Inputs that broke this path (issue 33's: non-ASCII digits in versions, a kubelet config
    nested 3,000 deep; this harness's: a 5,000-digit version, a billion-laughs threshold) must
    fail that update with a typed error within the bound, not end the agent."""
    harness.example((old_raw, new_raw, os_release))
    with bounded("osc pipeline (a known input)"):
        pipeline(old_raw, new_raw, os_release)
