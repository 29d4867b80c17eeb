"""Hypothesis strategies for hostile input to the agent: OSCs with in-place fields, the agent's
config, its state and progress files, and the cluster objects ``node-agent fleet`` reads.

Shared by the targets of ``tests/fuzz``. Where ``tests/unit`` has a strategy already it is
reused (files and units of ``test_osc_plan``, the YAML trees of ``test_osc_decode_load``, the
ledger and any-JSON of ``test_pacing``, Gardener's rendering of the config in
``tests/testbed/config_cases.py``); what is new here is the hostility: arbitrary Unicode,
NULs and terminal escapes, digits that are not ASCII, deep nesting, YAML aliases (billion
laughs), huge numbers and huge values.
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import yaml
from hypothesis import strategies as st

from node_agent.base import layout
from node_agent.commands import fleet
from node_agent.controllers.osc import pacing
from node_agent.kube import report
from node_agent.osc import inplace as ip
from tests.testbed.config_cases import GARDENER_RENDERED, SYNC_A
from tests.unit.test_containerd_config import _bases, _plugin
from tests.unit.test_containerd_registries import _url_text
from tests.unit.test_inplace import osc_doc as in_place_doc
from tests.unit.test_osc_decode_load import block, flow, trees
from tests.unit.test_osc_plan import PATHS, file_dicts, unit_dicts
from tests.unit.test_pacing import _json, _ledger

JSON = dict[str, Any]
HOST = "node-a"

#: how big a "huge" value gets (characters); the long run draws from the same range
HUGE = 300_000
#: how deep a "deep" document gets (levels)
DEEP = 5_000

# -- text ------------------------------------------------------------------------------------------

#: digits that ``str.isdigit``, ``\d`` or ``int`` take for numbers and Go does not
NON_ASCII_DIGITS = tuple(
    "\u00b2\u00b3\u00b9\u0663\u0664\u06f5\u0967\uff11\U0001d7d7\u2083\u2460\u07c1\u0beb"
)
#: what moves a terminal or hides text: ESC sequences, C1 controls, bidi overrides, NUL ...
TERMINAL = (
    "\x1b[2J",
    "\x1b]0;owned\x07",
    "\x1b[31m",
    "\x9b31m",
    "\r",
    "\x08",
    "\x7f",
    "\x00",
    "\u202e",
    "\u200b",
    "\ufeff",
    "\u2028",
    "\t",
    "\n",
)
#: what a YAML reader may take for syntax
YAML_BITS = ("&a", "*a", "!!binary", "<<", "{", "[", ": ", " #", "'", '"', "|", ">", "%", "---")

#: no lone surrogates: neither YAML nor JSON (nor the API server) can carry them
_chars = st.characters(exclude_categories=["Cs"])
_pieces = st.sampled_from(NON_ASCII_DIGITS + TERMINAL + YAML_BITS)


def rare(n: int) -> st.SearchStrategy[bool]:
    """True about once in ``n`` draws: a value in the middle of the range, which Hypothesis
    does not favour as it favours the ends (``integers(0, n) == 0`` comes up far more often)."""
    return st.integers(0, n - 1).map(lambda i: i == n // 2)


def texts(max_size: int = 24) -> st.SearchStrategy[str]:
    """Short text: arbitrary Unicode, or pieces that are hostile somewhere, mixed."""
    mixed = st.lists(_pieces | st.text(_chars, max_size=3), max_size=max_size // 3 + 1)
    return st.one_of(st.text(_chars, max_size=max_size), mixed.map("".join))


def huge_texts() -> st.SearchStrategy[str]:
    """One character or piece repeated up to ``HUGE`` characters."""
    return st.builds(
        lambda piece, n: (piece * (n // max(1, len(piece)) + 1))[:n],
        st.sampled_from(["a", "9", "\x00", "é", "\x1b[31m", "network problems ", "- "]),
        st.integers(1_000, HUGE),
    )


def hostile(max_size: int = 24) -> st.SearchStrategy[str]:
    """Text as an attacker or a broken cluster writes it; now and then a huge one."""
    return st.one_of(texts(max_size), texts(max_size), texts(max_size), huge_texts())


def numbers() -> st.SearchStrategy[Any]:
    """Numbers, and text that some reader takes for one."""
    spelled = st.sampled_from(
        ["1e3", "1E-2", "0x1F", "0o17", "017", "0b101", "1_000", ".5", "+.inf", "-.inf", ".nan",
         "1:30", "2001-12-14", "9" * 30, "-9" * 3, "18446744073709551616", "1e400", "0x_1"]
    )  # fmt: skip
    return st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
        spelled,
        st.integers(1, 40).map(lambda n: "9" * n),
    )


def versions() -> st.SearchStrategy[str]:
    """Version strings: mostly version-shaped, with non-ASCII digits, signs, huge numbers."""
    digit = st.sampled_from("0123456789") | st.sampled_from(NON_ASCII_DIGITS)
    part = st.one_of(
        st.text(digit, min_size=1, max_size=5),
        st.integers(0, 10**30).map(str),
        st.sampled_from(["", "x", "-1", "+1", " 1"]),
    )
    shaped = st.builds(
        lambda prefix, parts, suffix: prefix + ".".join(parts) + suffix,
        st.sampled_from(["", "", "v", "V", "vv"]),
        st.lists(part, min_size=1, max_size=4),
        st.sampled_from(["", "", "-dev", "+build.1", "~1", "-"]),
    )
    return st.one_of(shaped, shaped, st.sampled_from(["1.33.0", "1877.4", "1877.5", "1.34.1"]),
                     hostile(12))  # fmt: skip


def times() -> st.SearchStrategy[str]:
    """API times, and text that looks like one."""
    moments = st.datetimes(
        min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31), timezones=st.just(UTC)
    )
    return st.one_of(
        moments.map(lambda at: at.strftime("%Y-%m-%dT%H:%M:%SZ")),
        moments.map(lambda at: at.isoformat()),
        st.sampled_from(["2026-01-01T00:00:00", "2026-13-45T99:00:00Z", "", "now", "1e9"]),
        texts(8),
    )


# -- YAML that hurts -----------------------------------------------------------------------------


def deep_text(depth: int, style: str) -> str:
    """A document nested ``depth`` levels: flow sequences, flow or block mappings, JSON."""
    if style == "flow":
        return "[" * depth + "]" * depth
    if style == "json":
        return '{"a":' * depth + "1" + "}" * depth
    if style == "block":
        return "".join(f"{' ' * i}k:\n" for i in range(depth)) + " " * depth + "v\n"
    return "{a: " * depth + "b" + "}" * depth


def alias_bomb(levels: int, width: int) -> str:
    """Billion laughs, on one line: each level an anchored list of ``width`` aliases of the
    level below (``width ** levels`` values once expanded)."""
    items = ['l0: &l0 ["lol"]']
    for i in range(1, levels + 1):
        items.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]")
    return "{" + ", ".join(items) + "}"


def nasty_yaml() -> st.SearchStrategy[str]:
    """A whole YAML document that is deep, an alias bomb, or any tree of the decoder's tests."""
    styles = st.sampled_from(["flow", "json", "block", "map"])
    return st.one_of(
        st.builds(deep_text, st.integers(1, DEEP), styles),
        st.builds(alias_bomb, st.integers(1, 9), st.integers(2, 12)),
        st.builds(lambda tree, as_block: block(tree, 0) if as_block else flow(tree), trees,
                  st.booleans()),
    )  # fmt: skip


def flow_value(text: str) -> str:
    """``text`` (a document of :func:`nasty_yaml`) as one flow value, where that is possible."""
    if "\n" not in text.strip():
        return text.strip() or "~"
    return json.dumps(text)  # a block document goes in as a string


# -- OSCs with in-place fields ------------------------------------------------------------------


def quantities() -> st.SearchStrategy[Any]:
    valid = st.sampled_from(["100Mi", "1Gi", "5%", "0.5", "100m", "1e3", "10Ki", "+1", ".5Gi"])
    return st.one_of(valid, valid, texts(8), numbers(), st.none(), _json)


def kubelet_config_texts() -> st.SearchStrategy[str]:
    """The kubelet's config file in the OSC: a KubeletConfiguration, or anything else."""
    signals = st.sampled_from((*ip.EVICTION_SIGNALS, "pid.available", "x"))
    resources = st.sampled_from((*ip.RESERVED_RESOURCES, "gpu"))
    config = st.fixed_dictionaries(
        {"kind": st.just("KubeletConfiguration")},
        optional={
            "cpuManagerPolicy": st.sampled_from(["none", "static"]) | texts(8) | _json,
            "evictionHard": st.dictionaries(signals, quantities(), max_size=4) | _json,
            "kubeReserved": st.dictionaries(resources, quantities(), max_size=4) | _json,
        },
    )
    return st.one_of(
        config.map(lambda doc: yaml.safe_dump(doc, allow_unicode=True)),
        config.map(json.dumps),
        st.builds(bombed_kubelet_config, st.integers(1, 9), st.integers(2, 12), signals),
        nasty_yaml(),
        hostile(40),
    )


def bombed_kubelet_config(levels: int, width: int, signal: str) -> str:
    """A KubeletConfiguration whose eviction threshold is a billion-laughs value (a reader that
    turns it into text or compares it walks every expanded value)."""
    bomb = alias_bomb(levels, width)
    return (
        f"kind: KubeletConfiguration\nbombs: {bomb}\n"
        f"evictionHard:\n  {signal}: *l{levels}\nkubeReserved:\n  cpu: *l{levels}\n"
    )


def _kubelet_file(text: str, encoding: str) -> JSON:
    if encoding == "b64":
        data = base64.b64encode(text.encode("utf-8", "surrogatepass")).decode()
    elif encoding == "b64-garbage":
        encoding, data = "b64", text
    else:
        data = text
    return {"path": ip.KUBELET_CONFIG, "permissions": 0o644,
            "content": {"inline": {"encoding": encoding, "data": data}}}  # fmt: skip


def rotations() -> st.SearchStrategy[Any]:
    moment = times() | numbers() | st.none()
    one = st.fixed_dictionaries({}, optional={"lastInitiationTime": moment}) | _json
    mapping = st.fixed_dictionaries(
        {}, optional={"certificateAuthorities": one, "serviceAccountKey": one}
    )
    return st.one_of(mapping, mapping, mapping, _json)


def in_place_specs() -> st.SearchStrategy[Any]:
    kubelet = st.one_of(
        versions(),
        st.fixed_dictionaries(
            {"version": versions()},
            optional={"cpuManagerPolicy": st.sampled_from(["none", "static"]) | texts(6)},
        ),
        numbers(),
    )
    spec = st.fixed_dictionaries(
        {"operatingSystemVersion": versions(), "kubelet": kubelet},
        optional={"credentialsRotation": rotations(), "extra": _json},
    )
    return st.one_of(spec, spec, spec, spec, spec, _json)


def os_updates() -> st.SearchStrategy[Any]:
    arg = st.one_of(hostile(16), numbers(), st.none(), _json)
    update = st.fixed_dictionaries(
        {},
        optional={
            "command": st.sampled_from(["/opt/update.sh", "/bin/true"]) | hostile(24) | numbers(),
            "args": st.lists(arg, max_size=4) | hostile(8),
        },
    )
    return st.one_of(update, update, update, _json)


def hostile_files() -> st.SearchStrategy[JSON]:
    return st.fixed_dictionaries(
        {"path": st.sampled_from(PATHS) | st.just("/etc/x/") | texts(20).map(lambda t: "/" + t),
         "content": st.fixed_dictionaries(
             {}, optional={"inline": st.fixed_dictionaries(
                 {}, optional={"encoding": st.sampled_from(["", "b64", "gzip"]) | texts(4),
                               "data": hostile(30)}),
                 "secretRef": st.fixed_dictionaries({"name": texts(6), "dataKey": texts(6)}),
                 "imageRef": st.fixed_dictionaries({"image": texts(8),
                                                    "filePathInImage": texts(8)})})},
        optional={"permissions": numbers(),
                  "hostName": st.sampled_from([HOST, "other"]) | texts(6)},
    )  # fmt: skip


def hostile_units() -> st.SearchStrategy[JSON]:
    return st.fixed_dictionaries(
        {"name": st.sampled_from(["a.service", "b@.service", "k.service"]) | texts(12)},
        optional={
            "content": hostile(40),
            "enable": st.booleans() | numbers(),
            "command": st.sampled_from(["start", "stop", "restart", "reload"]),
            "dropIns": st.lists(
                st.fixed_dictionaries({"name": texts(10) | st.just("10-a.conf"),
                                       "content": hostile(20)}), max_size=2),
            "filePaths": st.lists(st.sampled_from(PATHS) | texts(8), max_size=2),
        },
    )  # fmt: skip


def cri_configs() -> st.SearchStrategy[Any]:
    """``spec.criConfig``: containerd with registry mirrors, a sandbox image and plugin edits
    (the containerd tests' own strategies), now and then hostile or of the wrong shape."""
    host = st.fixed_dictionaries(
        {"url": _url_text.map(lambda t: "https://" + t) | texts(12)},
        optional={
            "capabilities": st.lists(
                st.sampled_from(["pull", "resolve", "push"]) | texts(4), max_size=2
            ),
            "caCerts": st.lists(texts(12) | st.just("/etc/ssl/ca.crt"), max_size=2),
            "overridePath": st.booleans() | numbers(),
        },
    )
    registry = st.fixed_dictionaries(
        {"upstream": st.sampled_from(["docker.io", "localhost:5000", "..", "a/b"]) | texts(10)},
        optional={
            "server": _url_text.map(lambda t: "https://" + t) | texts(10),
            "hosts": st.lists(host, max_size=2),
            "readinessProbe": st.just(False),
        },
    )
    containerd = st.fixed_dictionaries(
        {},
        optional={
            "registries": st.lists(registry, max_size=3),
            "sandboxImage": st.sampled_from(["registry.k8s.io/pause:3.10"]) | hostile(20),
            "plugins": st.lists(_plugin, max_size=2) | _json,
        },
    )
    return st.one_of(
        st.fixed_dictionaries(
            {"name": st.just("containerd"), "containerd": containerd},
            optional={"cgroupDriver": st.sampled_from(["systemd", "cgroupfs"]) | texts(6)}),
        _json,
    )  # fmt: skip


#: what ``containerd config default`` printed on the node (the containerd tests' samples)
config_toml_bases = _bases


@st.composite
def osc_docs(draw: st.DrawFn, *, in_place: bool = True) -> JSON:
    """An OperatingSystemConfig document (a dict) of an in-place pool: its kubelet config file,
    ``spec.inPlaceUpdates``, ``status.inPlaceUpdates.osUpdate``, ordinary files and units (the
    planner's own strategies), and now and then hostile items or unknown fields."""
    files = [draw(file_dicts(p)) for p in draw(st.lists(st.sampled_from(PATHS), unique=True))]
    if not draw(rare(10)):
        encoding = draw(st.sampled_from(["b64", "b64", "", "b64-garbage"]))
        files.insert(0, _kubelet_file(draw(kubelet_config_texts()), encoding))
    units = draw(st.lists(unit_dicts, max_size=3))
    if draw(rare(6)):
        files.append(draw(hostile_files()))
    if draw(rare(6)):
        units.append(draw(hostile_units()))
    spec: JSON = {"type": "gardenlinux", "purpose": "reconcile", "files": files, "units": units}
    status: JSON = {}
    if in_place and not draw(rare(10)):
        spec["inPlaceUpdates"] = draw(in_place_specs())
        status["inPlaceUpdates"] = {"osUpdate": draw(os_updates())}
    doc: JSON = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "metadata": {"name": "osc"},
        "spec": spec,
        "status": status,
    }
    if draw(rare(8)):
        doc["spec"]["unknownField"] = draw(_json)
    if draw(rare(3)):
        doc["spec"]["criConfig"] = draw(cri_configs())
    return doc


def _dump(doc: JSON, style: str) -> str:
    if style == "json":  # escaped: a raw C1 control or DEL is not YAML (libyaml refuses it)
        return json.dumps(doc)
    flow_style = style == "flow"
    return yaml.safe_dump(doc, default_flow_style=flow_style, allow_unicode=True, width=1 << 30)


@st.composite
def osc_bytes(draw: st.DrawFn, doc: JSON) -> bytes:
    """``doc`` as the bytes of ``osc.yaml``: block or flow YAML or JSON, sometimes with a nasty
    document spliced in (a deep one, an alias bomb) or with bytes changed."""
    style = draw(st.sampled_from(["block", "block", "flow", "json"]))
    text = _dump(doc, style)
    if style == "block" and draw(rare(6)):
        key = draw(st.sampled_from(["extra", "spec"]))
        nasty = draw(nasty_yaml())
        if key == "extra":
            text += f"extra: {flow_value(nasty)}\n"
        else:  # the nasty document as the kubelet's config, inline
            text = text.replace("spec:\n", f"spec:\n  extraConfig: {flow_value(nasty)}\n", 1)
    raw = text.encode("utf-8", "surrogatepass")
    if draw(rare(16)) and len(raw) > 2:
        at = draw(st.integers(1, len(raw) - 1))
        raw = (
            raw[:at]
            + draw(st.sampled_from([b"\x00", b"\xff", b"\t", b"&a ", b"*a", b"\n- "]))
            + raw[at:]
        )
    return raw


def applied_docs() -> st.SearchStrategy[JSON]:
    """The OSC applied before an update: mostly a good one of an in-place pool (so that the
    update's in-place parts are compared with something), now and then any."""
    good = st.builds(
        lambda os_version, kubelet, policy: in_place_doc(
            os_version=os_version, kubelet=kubelet, config={"cpuManagerPolicy": policy}
        ),
        st.sampled_from(["1877.4", "1877.5", "1592.0"]),
        st.sampled_from(["1.33.0", "1.34.1", "v1.32.9"]),
        st.sampled_from(["none", "static"]),
    )
    return st.one_of(good, good, good, osc_docs())


def os_releases() -> st.SearchStrategy[str | None]:
    return st.one_of(
        st.none(),
        versions().map(lambda v: f'ID=gardenlinux\nPRETTY_NAME="Garden Linux {v}"\n'),
        hostile(30).map(lambda t: f"PRETTY_NAME={t}\n"),
        st.just('PRETTY_NAME="Garden Linux 1877.4"\n'),
    )


def checksum(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


# -- NodeAgentConfiguration ----------------------------------------------------------------------

_GARDENER: JSON = yaml.safe_load(GARDENER_RENDERED)

_CONFIG_FIELDS: tuple[tuple[str, ...], ...] = (
    ("logLevel",),
    ("logFormat",),
    ("clientConnection", "qps"),
    ("clientConnection", "burst"),
    ("clientConnection", "kubeconfig"),
    ("server", "healthProbes", "port"),
    ("server", "metrics", "port"),
    ("apiServer", "server"),
    ("apiServer", "caFile"),
    ("bootstrap", "kubeletDataVolumeSize"),
    ("featureGates",),
    ("controllers", "operatingSystemConfig", "syncPeriod"),
    ("controllers", "operatingSystemConfig", "secretName"),
    ("controllers", "operatingSystemConfig", "kubernetesVersion"),
    ("controllers", "token", "syncPeriod"),
    ("controllers", "systemdUnitCheck", "stuckThreshold"),
    ("nodeAgent", "healthGate", "settleWindow"),
    ("nodeAgent", "restartGuard", "maxRestarts"),
    ("nodeAgent", "restartGuard", "window"),
    ("nodeAgent", "healthCheck", "timeout"),
    ("nodeAgent", "images", "pullTimeout"),
    ("nodeAgent", "rollout", "recheckMax"),
    ("someUnknownField",),
)

#: token paths that can never be right, or that would overwrite the agent's own files
TOKEN_PATHS = (
    "relative/token",
    "/var/lib/x/../../etc/passwd",
    "/var/lib/x/tok\x00en",
    layout.KUBECONFIG_FILE,
    layout.TOKEN_FILE,
    layout.BOOTSTRAP_TOKEN_FILE,
    f"{layout.BASE_DIR}/{layout.INVENTORY}",
    f"{layout.BASE_DIR}/{layout.LAST_APPLIED_OSC}",
    layout.CREDENTIALS_DIR,
    "/var/lib/valitail/auth-token",
    "/",
    "",
)


def _durations() -> st.SearchStrategy[Any]:
    spelled = st.sampled_from(
        ["15s", "1m30s", ".5m", "1h", "-1s", "0", "99999999999999h", "9" * 400 + "h",
         "\u0661\u0665s", "15 s", "1e3s", "15000000µs", "2562047h47m16.854775807s", "2562048h"]
    )  # fmt: skip
    return spelled | numbers() | texts(6)


def _value_for(path: tuple[str, ...]) -> st.SearchStrategy[Any]:
    last = path[-1]
    if last in ("syncPeriod", "stuckThreshold", "settleWindow", "window", "timeout",
                "pullTimeout", "recheckMax"):  # fmt: skip
        return _durations() | _json
    if last == "kubernetesVersion":
        return versions() | numbers()
    return st.one_of(numbers(), texts(12), _json, huge_texts())


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A NodeAgentConfiguration file: Gardener's rendering with fields changed (hostile values,
    token paths, unknown fields nested deep, an alias bomb, YAML scalars as Go reads them), or
    a nasty document as a whole."""
    if draw(rare(10)):
        return draw(nasty_yaml())
    doc: JSON = json.loads(json.dumps(_GARDENER))
    for path in draw(st.lists(st.sampled_from(_CONFIG_FIELDS), max_size=4, unique=True)):
        node = doc
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = draw(_value_for(path))
    if draw(st.booleans()):
        sync = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"secretName": st.sampled_from(["gardener-node-agent", "valitail"]) | texts(6),
                     "path": st.sampled_from(TOKEN_PATHS) | texts(16)})
                | st.just(SYNC_A), max_size=3)
        )  # fmt: skip
        doc["controllers"]["token"]["syncConfigs"] = sync
    text = yaml.safe_dump(doc, allow_unicode=True, width=1 << 30)
    extra = draw(st.sampled_from(["none", "deep", "bomb", "scalar", "none", "none"]))
    if (
        extra == "deep"
    ):  # an unknown field nested deep (upstream takes 1,000 levels, refuses 100,000)
        text += f"unknownDeep: {deep_text(draw(st.integers(1, DEEP)), 'map')}\n"
    elif extra == "bomb":
        text += f"bomb: {alias_bomb(draw(st.integers(1, 9)), draw(st.integers(2, 12)))}\n"
    elif extra == "scalar":
        field = draw(st.sampled_from(["logLevel", "controllers: {x", "qps"]))
        text += f"{field}: {draw(numbers()) if field == 'qps' else draw(texts(10))!s}\n"
    return text


# -- the agent's state and progress files ---------------------------------------------------------

_STEP_IDS = st.sampled_from(["file:/etc/a", "unit:a.service", "reload", "cmd:a.service", "x"])
CLAIMED_PATHS = (
    "/etc/a",
    "/etc/passwd",
    "/etc/operator.conf",
    f"{layout.UNIT_DIR}/a.service",
    f"{layout.UNIT_DIR}/a.service.d/10-a.conf",
    layout.KUBECONFIG_FILE,
    layout.TOKEN_FILE,
    f"{layout.BASE_DIR}/cluster-ca.crt",
    f"{layout.BASE_DIR}/{layout.INVENTORY}",
    f"{layout.BASE_DIR}/{layout.CHANGES_DONE}",
    "/etc/dir-now",
    "/etc/linked/file",
    "relative",
    "/etc/../etc/passwd",
)


def _entries() -> st.SearchStrategy[Any]:
    entry = st.fixed_dictionaries(
        {"kind": st.sampled_from(["file", "unit", "dropin"]) | texts(4),
         "created": st.booleans()},
        optional={"sha256": st.sampled_from([None, "0" * 64, checksum(b"mine\n")]) | texts(8),
                  "mode": numbers() | st.none()},
    )  # fmt: skip
    paths = st.sampled_from(CLAIMED_PATHS) | texts(16)
    return st.dictionaries(paths, entry, max_size=5) | _json


def _change_sets() -> st.SearchStrategy[Any]:
    write = st.fixed_dictionaries(
        {"path": st.sampled_from(CLAIMED_PATHS) | texts(8), "mode": numbers(), "reason": texts(6)},
        optional={"content": st.sampled_from(["bWluZQo=", "!!"]) | texts(6),
                  "sha256": st.none() | texts(6)},
    )  # fmt: skip
    return st.one_of(
        st.fixed_dictionaries(
            {},
            optional={
                "files_to_write": st.lists(write, max_size=3),
                "units_to_enable": st.lists(texts(8), max_size=2),
                "unit_commands": st.lists(
                    st.fixed_dictionaries(
                        {"unit": texts(8), "action": st.sampled_from(["restart", "stop", "x"]),
                         "reasons": st.lists(texts(6), max_size=2)},
                        optional={"is_agent": st.booleans(), "removed": st.booleans()}),
                    max_size=2),
                "reload": st.booleans() | numbers(),
            },
        ),
        _json,
    )  # fmt: skip


def state_documents() -> st.SearchStrategy[dict[str, Any]]:
    """The JSON documents of the state directory, by file name, each shaped like the real one
    with hostile values (or any JSON): the journal, its progress file and its claims, the
    inventory, the last applied OSC's meta, the last apply's status, the in-place record."""
    version = st.sampled_from([1, 1, 1, 2, "1", None])
    ident = st.sampled_from(["j1", "j2"]) | texts(6)
    moment = times() | numbers()
    at = st.datetimes(
        min_value=datetime(1970, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
    ).map(lambda moment: moment.strftime("%Y-%m-%dT%H:%M:%SZ"))
    docs = {
        layout.CHANGES: st.fixed_dictionaries(
            {"version": version, "id": ident, "osc_checksum": texts(8), "started_at": moment,
             "change_set": _change_sets()},
            optional={"preexisting": st.lists(texts(8), max_size=2), "base_checksum": texts(4)}),
        layout.CHANGES_DONE: st.fixed_dictionaries(
            {"version": version, "id": ident},
            optional={"done": st.lists(_STEP_IDS | texts(6), max_size=4),
                      "failed": st.dictionaries(_STEP_IDS, hostile(20), max_size=2) | _json,
                      "claims": _entries()}),
        layout.INVENTORY: st.fixed_dictionaries(
            {"version": version}, optional={"entries": _entries(), "folded": ident | st.none()}),
        layout.LAST_APPLIED_META: st.fixed_dictionaries(
            {"version": version, "checksum": texts(8), "applied_at": moment},
            optional={"resolved": st.dictionaries(texts(8), texts(8), max_size=2) | _json,
                      "applied": _json}),
        layout.STATUS: st.fixed_dictionaries(
            {"version": version, "started_at": moment, "finished_at": moment,
             "duration_seconds": numbers(), "result": st.sampled_from(["succeeded", "failed"])},
            optional={"error": hostile(30), "restarted_units": st.lists(hostile(10), max_size=2),
                      "failures": st.lists(st.fixed_dictionaries(
                          {"kind": texts(6), "item": hostile(10), "error": hostile(30)}),
                          max_size=2)}),
        layout.IN_PLACE: st.fixed_dictionaries(
            {"version": version, "checksum": texts(8), "began_at": moment,
             "detected": _json, "remaining": _json},
            optional={"failed": hostile(30) | st.none(), "target_os": versions()}),
        layout.HISTORY: st.fixed_dictionaries(
            {"version": st.just(1),
             "entries": st.lists(st.fixed_dictionaries(
                 {"started_at": at, "finished_at": at,
                  "duration_seconds": st.floats(0, 1e9) | numbers(),
                  "trigger": st.sampled_from(["secret", "drift", "in-place"]),
                  "result": st.sampled_from(["succeeded", "failed"])},
                 optional={"checksum_to": texts(8), "error": hostile(40),
                           "items_changed": st.lists(hostile(12), max_size=3),
                           "restarted_units": st.lists(hostile(12), max_size=2),
                           "failures": st.lists(st.fixed_dictionaries(
                               {"kind": texts(6), "item": hostile(10), "error": hostile(30)}),
                               max_size=2),
                           "rollback": _json}),
                 min_size=1, max_size=4)}) | _json,
    }  # fmt: skip
    return st.fixed_dictionaries({}, optional=docs)


def state_bytes(doc: Any) -> st.SearchStrategy[bytes]:
    """One state file: the document as JSON, or that JSON damaged, deep, huge or not JSON."""
    text = json.dumps(doc, ensure_ascii=False)
    return st.one_of(
        st.just(text.encode("utf-8", "surrogatepass")),
        st.just(text.encode("utf-8", "surrogatepass")),
        st.integers(0, len(text)).map(lambda n: text[:n].encode("utf-8", "surrogatepass")),
        st.builds(deep_text, st.integers(1, DEEP), st.just("json")).map(str.encode),
        st.binary(max_size=64),
        huge_texts().map(lambda t: json.dumps({"version": 1, "id": t}).encode()),
    )


# -- the cluster objects node-agent fleet reads ---------------------------------------------------

_NODE_NAMES = ("n1", "n2", "n3", "n4")
_POOLS = ("p1", "p2", "")
_SECRETS = ("gardener-node-agent-p1", "gardener-node-agent-p2")
_CHECKSUMS = (checksum(b"a"), checksum(b"b"))


def _label_values() -> st.SearchStrategy[str]:
    """What the API server lets through as a label value (63 characters, [A-Za-z0-9._-])."""
    return st.from_regex(r"\A([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?\Z")


def _free_text() -> st.SearchStrategy[str]:
    """Annotations, messages, holder identities: any text a node's agent may write."""
    return hostile(40) | st.sampled_from(_CHECKSUMS)


def _annotation_map(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, str]]:
    return st.dictionaries(st.sampled_from(keys), _free_text(), max_size=len(keys))


def _conditions() -> st.SearchStrategy[list[JSON]]:
    condition = st.fixed_dictionaries(
        {"type": st.sampled_from([report.CONDITION_ROLLOUT, report.CONDITION_UNITS_READY, "Ready"]),
         "status": st.sampled_from(["True", "False", "Unknown"]),
         "reason": st.sampled_from([report.REASON_ROLLOUT_FAILED, report.REASON_ROLLOUT_APPLYING,
                                    pacing.REASON_SLOT]) | texts(10),
         "message": _free_text() | st.sampled_from(
             ["a.service: failed; b.service: node-agent stopped restarting it",
              f"OSC {_CHECKSUMS[0][:12]} rolled back"])},
        optional={"lastTransitionTime": times()},
    )  # fmt: skip
    return st.lists(condition, max_size=3)


def nodes() -> st.SearchStrategy[JSON]:
    return st.fixed_dictionaries(
        {"metadata": st.fixed_dictionaries(
            {"name": st.sampled_from(_NODE_NAMES),
             "labels": st.fixed_dictionaries({}, optional={
                 fleet.LABEL_POOL: st.sampled_from(_POOLS),
                 report.LABEL_SECRET_NAME: st.sampled_from(_SECRETS),
                 report.LABEL_KUBERNETES_VERSION: _label_values()}),
             "annotations": _annotation_map((report.ANNOTATION_APPLIED_CHECKSUM, "other"))}),
         "status": st.fixed_dictionaries({"conditions": _conditions()}, optional={
             "nodeInfo": st.fixed_dictionaries({"kubeletVersion": _free_text()})})},
    )  # fmt: skip


def _policy_annotations() -> st.SearchStrategy[dict[str, str]]:
    value = st.one_of(
        st.sampled_from(["1", "2", "0", "-1", "true", "90s", "1000h", "99999999999999h", "\u0661",
                         " 3 ", "1_0", "9" * 30, "1e3", ""]),
        texts(8),
    )  # fmt: skip
    keys = (
        pacing.ANNOTATION_MAX_PARALLEL,
        pacing.ANNOTATION_CANARIES,
        pacing.ANNOTATION_SOAK,
        pacing.ANNOTATION_MAX_FAILURES,
        report.ANNOTATION_SERIAL,
        pacing.ANNOTATION_SLOT_TTL,
    )
    return st.dictionaries(st.sampled_from(keys), value, max_size=len(keys))


def policy_annotations() -> st.SearchStrategy[dict[str, str]]:
    """The rollout annotations of an OSC Secret, read by the agents and by ``fleet``."""
    return _policy_annotations()


def secrets() -> st.SearchStrategy[JSON]:
    annotations = st.builds(
        lambda policy, desired: {**policy, **desired},
        _policy_annotations(),
        _annotation_map((report.ANNOTATION_SECRET_CHECKSUM,)),
    )
    return st.fixed_dictionaries(
        {"metadata": st.fixed_dictionaries(
            {"name": st.sampled_from(_SECRETS),
             "labels": st.fixed_dictionaries({fleet.LABEL_POOL: st.sampled_from(_POOLS)}),
             "annotations": annotations},
            optional={"creationTimestamp": times(),
                      "managedFields": st.lists(st.fixed_dictionaries({"time": times()}),
                                                max_size=2)})},
    )  # fmt: skip


def leases() -> st.SearchStrategy[JSON]:
    ledger = st.one_of(_ledger.map(json.dumps), _free_text())
    name = st.sampled_from(_SECRETS) | st.sampled_from(_NODE_NAMES).map(
        lambda n: fleet.LEASE_PREFIX + n
    )
    return st.fixed_dictionaries(
        {"metadata": st.fixed_dictionaries(
            {"name": name},
            optional={"annotations": st.dictionaries(st.just(pacing.ANNOTATION_LEDGER), ledger)}),
         "spec": st.fixed_dictionaries({}, optional={
             "holderIdentity": _free_text(),
             "renewTime": times(),
             "acquireTime": times(),
             "leaseDurationSeconds": st.integers(-(2**31), 2**31 - 1)})},
    )  # fmt: skip


def events() -> st.SearchStrategy[JSON]:
    return st.fixed_dictionaries(
        {"involvedObject": st.fixed_dictionaries(
            {"kind": st.sampled_from(["Node", "Pod"]), "name": st.sampled_from(_NODE_NAMES)}),
         "reason": st.sampled_from([report.REASON_OSC_APPLIED, report.REASON_OSC_ROLLED_BACK,
                                    report.REASON_OSC_FAILED]) | texts(8),
         "type": st.sampled_from(["Normal", "Warning"]),
         "message": _free_text()},
        optional={"lastTimestamp": times()},
    )  # fmt: skip


# -- plain YAML scalars, for the readers that must agree -------------------------------------------


def plain_scalars() -> st.SearchStrategy[str]:
    """Text a YAML reader resolves as a plain scalar: numbers in every spelling, bools, nulls."""
    alphabet = "0123456789+-._eExXoObBaAfFinINyYnNtTul:~"
    return st.one_of(
        st.text(st.sampled_from(alphabet), min_size=1, max_size=12),
        numbers().map(str),
        st.sampled_from(["1e3", "1E3", "1.5e3", "1e+3", "-1e-3", ".5e1", "5.", "0x1_F", "0b1_0",
                         "0o7_7", "07_7", "+0x10", "-0b11", "1_000.5", "Null", "NO", "on", "y",
                         "~", ".NaN", "+.Inf", "2001-12-14", "190:20:30", "0.", "-.5"]),
    )  # fmt: skip
