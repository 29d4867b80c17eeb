"""NodeAgentConfiguration files that upstream gardener-node-agent accepts or refuses, per release.

One table for two tests: tests/unit/test_config_upstream.py checks that node-agent gives each
file the verdict listed here (and that a refusal names the field), and
tests/integration/test_config_oracle.py starts upstream's own binary on each file and checks that
the listed verdict is upstream's. Every case is Gardener's own rendering of the file (as its
generator writes it for a worker pool) with one change. A release up to v1.146 renders the
cluster CA inline (``caBundle``) instead of the file's path: :func:`for_release` gives each case
as that release's Gardener would render it, and :meth:`ConfigCase.accepted_in` the release's
verdict where it differs from the newest's.
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass
from typing import Any

import yaml

from node_agent.base import versions

#: the file exactly as Gardener v1.150.0 renders it for a pool (gardener-gen, shape k8s-1.33)
GARDENER_RENDERED = """\
apiServer:
  caFile: /var/lib/gardener-node-agent/cluster-ca.crt
  server: https://api.testshoot.testproj.example:443
apiVersion: nodeagent.config.gardener.cloud/v1alpha1
bootstrap: {}
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: ""
  qps: 0
controllers:
  operatingSystemConfig:
    kubernetesVersion: 1.33.0
    secretName: gardener-node-agent-worker-f8cc3ecb9ae0b769
  systemdUnitCheck: {}
  token:
    syncPeriod: 12h0m0s
kind: NodeAgentConfiguration
logFormat: ""
logLevel: ""
server: {}
"""

_DELETE = object()


#: gardener-gen's stand-in cluster CA, as releases up to v1.146 render it (``caBundle``)
TEST_CA_BUNDLE = base64.b64encode(
    b"-----BEGIN CERTIFICATE-----\nTUlJQnRlc3RidW5kbGU=\n-----END CERTIFICATE-----\n"
).decode()
_CA_FILE_LINE = "  caFile: /var/lib/gardener-node-agent/cluster-ca.crt\n"


def _before(release: str, other: str) -> bool:
    return versions.precedence(versions.semver(release)) < versions.precedence(
        versions.semver(other)
    )


def for_release(text: str, release: str) -> str:
    """``text`` as Gardener ``release`` renders it: up to v1.146 the CA bundle inline instead of
    the file's path (a case that sets ``caBundle`` itself keeps both)."""
    if not _before(release, "v1.147.0") or "caBundle" in text:
        return text
    return text.replace(_CA_FILE_LINE, f"  caBundle: {TEST_CA_BUNDLE}\n")


@dataclass(frozen=True)
class ConfigCase:
    """One file and upstream's verdict; ``field``: what a refusal must name."""

    name: str
    text: str
    #: the verdict of the newest release
    accepted: bool
    field: str = ""
    #: the verdict of the releases up to v1.146 (``caBundle``) where it differs
    accepted_with_ca_bundle: bool | None = None
    #: the verdict of v1.141 (Kubernetes 1.31 to 1.35) where it differs
    accepted_by_v1_141: bool | None = None

    def accepted_in(self, release: str) -> bool:
        if _before(release, "v1.145.0") and self.accepted_by_v1_141 is not None:
            return self.accepted_by_v1_141
        if _before(release, "v1.147.0") and self.accepted_with_ca_bundle is not None:
            return self.accepted_with_ca_bundle
        return self.accepted


def _with(changes: dict[str, Any]) -> str:
    """Gardener's rendering with ``changes`` applied (dotted paths; _DELETE removes a key)."""
    doc: dict[str, Any] = yaml.safe_load(GARDENER_RENDERED)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = copy.deepcopy(value)
    return yaml.safe_dump(doc, sort_keys=True)


def _raw(old: str, new: str) -> str:
    """Gardener's rendering with one line's text replaced (for YAML the dumper would quote)."""
    assert old in GARDENER_RENDERED, old
    return GARDENER_RENDERED.replace(old, new, 1)


def ok(name: str, changes: dict[str, Any] | None = None, *, text: str = "") -> ConfigCase:
    return ConfigCase(name, text if changes is None else _with(changes), True)


def refused(
    name: str, field: str, changes: dict[str, Any] | None = None, *, text: str = ""
) -> ConfigCase:
    return ConfigCase(name, text if changes is None else _with(changes), False, field)


def _appended(text: str) -> str:
    """Gardener's rendering with ``text`` (an unknown top-level field) after it."""
    return GARDENER_RENDERED + text


def _flow_depth(levels: int) -> str:
    """An unknown field of ``levels`` nested flow mappings: the JSON nests ``levels + 1`` deep,
    go-yaml's scanner counts ``levels`` flow levels."""
    return _appended("someNewField: " + "{a: " * levels + "1" + "}" * levels + "\n")


def _bracket_depth(levels: int) -> str:
    """``levels`` nested flow sequences, one byte each way (100,000 levels in 200 KB)."""
    return _appended("someNewField: " + "[" * levels + "]" * levels + "\n")


def _block_depth(levels: int) -> str:
    """``levels`` nested block sequences on one line (``- - - 1``): each ``- `` is one more
    indentation level of go-yaml's scanner (the document's mapping is one more)."""
    return _appended("someNewField:\n " + "- " * levels + "1\n")


def _aliases(items: int, uses: int) -> str:
    """An anchored list of ``items`` scalars, then a list of ``uses`` aliases of it."""
    return _appended(
        f"aliases:\n  anchor: &a [{','.join(['x'] * items)}]\n  uses: [{','.join(['*a'] * uses)}]\n"
    )


#: the classic "billion laughs", 9 levels of 9 aliases (9^9 "lol"s once expanded), as a field
BILLION_LAUGHS = _appended(
    "laughs:\n"
    + '  l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(f"  l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))
)

MERGE_LOG_LEVEL = "<<: {logLevel: info}\n"

OSC = "controllers.operatingSystemConfig"
TOKEN = "controllers.token"
CHECK = "controllers.systemdUnitCheck"
VERSION = f"{OSC}.kubernetesVersion"
SECRET = "secretName: gardener-node-agent-worker-f8cc3ecb9ae0b769"
SYNC_A = {"secretName": "gardener-node-agent", "path": "/var/lib/gardener-node-agent/token"}
SYNC_B = {"secretName": "valitail", "path": "/var/lib/valitail/auth-token"}
KUBECONFIG = "/var/lib/gardener-node-agent/credentials/kubeconfig"
#: go-yaml's and Go JSON's own reasons: upstream's refusal names them too
GO_YAML_REASONS = (
    "max depth",
    "excessive aliasing",
    "contains itself",
    "unknown anchor",
    "map merge",
)

CASES: tuple[ConfigCase, ...] = (
    # --- accepted: Gardener's rendering, its zero values, nulls, omissions ---------------------
    ok("gardener-rendered", text=GARDENER_RENDERED),
    ok("no-type-meta", {"apiVersion": _DELETE, "kind": _DELETE}),
    ok("empty-type-meta", {"apiVersion": "", "kind": ""}),
    ok("null-sections", {"clientConnection": None, "server": None, "bootstrap": None}),
    ok("null-fields", {"logLevel": None, "featureGates": None, f"{TOKEN}.syncPeriod": None}),
    ok("unknown-fields", {"someNewField": 1, "controllers.someNewController": {"x": 1}}),
    ok("go-spelling-only", {f"{OSC}.secret_name": "ignored-by-upstream"}),
    ok("burst-and-qps", {"clientConnection.burst": 5, "clientConnection.qps": 0.5}),
    ok("negative-qps", {"clientConnection.qps": -1}),
    ok("integral-float-burst", text=_raw("  burst: 0\n", "  burst: 7.0\n")),
    ok("log-debug-text", {"logLevel": "debug", "logFormat": "text"}),
    ok("log-error", {"logLevel": "error"}),
    ok("feature-gates-all-alpha", {"featureGates": {"AllAlpha": True, "AllBeta": False}}),
    ok("ports", {"server.healthProbes": {"port": 8080}, "server.metrics": {"port": 0}}),
    ok("port-out-of-range", {"server.metrics": {"port": 70000}}),
    ok("debugging", {"debugging": {"enableProfiling": True}}),
    ok("data-volume", {"bootstrap.kubeletDataVolumeSize": 68719476736}),
    ok("sync-period-15s", {f"{OSC}.syncPeriod": "15s"}),
    ok("sync-period-fraction", {f"{OSC}.syncPeriod": ".25m"}),
    ok("sync-period-plus", {f"{OSC}.syncPeriod": "+1m30s"}),
    ok("sync-period-ms", {f"{OSC}.syncPeriod": "15000ms"}),
    ok("sync-period-micro-sign", {f"{OSC}.syncPeriod": "15000000\u00b5s"}),
    ok("sync-period-greek-mu", {f"{OSC}.syncPeriod": "15000000\u03bcs"}),
    ok("stuck-threshold-30s", {f"{CHECK}.stuckThreshold": "30s", f"{CHECK}.syncPeriod": "15s"}),
    ok("token-sync-configs", {f"{TOKEN}.syncConfigs": [SYNC_A, SYNC_B]}),
    # upstream's decode takes any path; node-agent refuses such an entry when it syncs it
    ok("sync-config-relative-path", {f"{TOKEN}.syncConfigs": [{**SYNC_B, "path": "var/token"}]}),
    ok("sync-config-dot-dot", {f"{TOKEN}.syncConfigs": [{**SYNC_B, "path": "/var/lib/../token"}]}),
    ok("sync-config-nul", {f"{TOKEN}.syncConfigs": [{**SYNC_B, "path": "/var/lib/to\0ken"}]}),
    ok("sync-config-agents-kubeconfig", {f"{TOKEN}.syncConfigs": [{**SYNC_B, "path": KUBECONFIG}]}),
    ok("version-oldest", {VERSION: "1.32.0"}),
    ConfigCase("version-newest", _with({VERSION: "1.36.99"}), True, VERSION, None, False),
    ok("version-v-prefix", {VERSION: "v1.34.2"}),
    ok("version-minor-only", {VERSION: "1.35"}),
    ok("version-prerelease", {VERSION: "1.33.0-rc.1"}),
    ok("version-build", {VERSION: "1.33.4+build.7"}),
    ok("version-leading-zeros", {VERSION: "01.033.00"}),
    # --- YAML as go-yaml v2 resolves it (sigs.k8s.io/yaml), not as PyYAML does ---------------
    ok("yaml-exponent-float", text=_raw("  qps: 0\n", "  qps: 1e38\n")),
    ok("yaml-hex-int", text=_raw("  burst: 0\n", "  burst: 0x10\n")),
    ok("yaml-duplicate-key", text=GARDENER_RENDERED + "logLevel: debug\n"),
    ok("yaml-second-document", text=GARDENER_RENDERED + "---\nlogLevel: bogus\n"),
    ok("yaml-merge-key", text=_raw("  token:\n", "  token:\n    <<: {syncPeriod: 1h}\n")),
    ok("yaml-date-is-a-string", text=_raw(SECRET, "secretName: 2001-12-14")),
    ok("yaml-sexagesimal-is-a-string", text=_raw(SECRET, "secretName: 1:30")),
    refused("yaml-y-is-a-bool", f"{OSC}.secretName", text=_raw(SECRET, "secretName: y")),
    refused("yaml-exponent-is-a-number", f"{OSC}.secretName", text=_raw(SECRET, "secretName: 1e3")),
    refused("yaml-dot-float", f"{OSC}.secretName", text=_raw(SECRET, "secretName: .5_5")),
    refused("yaml-infinity", "JSON", text=_raw("  qps: 0\n", "  qps: .inf\n")),
    refused("yaml-nan-unknown-field", "JSON", text=GARDENER_RENDERED + "someNewField: .nan\n"),
    refused("yaml-null-key", "JSON", text=GARDENER_RENDERED + "featureGates: {~: true}\n"),
    refused(
        "qps-float32-overflow", "clientConnection.qps", text=_raw("  qps: 0\n", "  qps: 1e39\n")
    ),
    refused(
        "version-capital-v",
        VERSION,
        text=_raw("kubernetesVersion: 1.33.0", "kubernetesVersion: V1.33.0"),
    ),
    refused("version-four-parts", VERSION, {VERSION: "1.33.0.1"}),
    refused("version-space", VERSION, {VERSION: " 1.33.0"}),
    refused("version-huge-patch", VERSION, {VERSION: "1.33.99999999999999999999"}),
    refused("kind-lower-case", "kind", {"kind": "nodeagentconfiguration"}),
    refused("api-version-no-group", "apiVersion", {"apiVersion": "v1alpha1"}),
    refused("sync-config-null", f"{TOKEN}.syncConfigs[0]", {f"{TOKEN}.syncConfigs": [None]}),
    refused("sync-period-exponent", f"{TOKEN}.syncPeriod", {f"{TOKEN}.syncPeriod": "1e3s"}),
    refused(
        "sync-period-int64", f"{TOKEN}.syncPeriod", {f"{TOKEN}.syncPeriod": "9223372036854775808ns"}
    ),
    ok("sync-period-int64-max", {f"{TOKEN}.syncPeriod": "9223372036854775807ns"}),
    # --- go-yaml's limits: depth, aliases (the upstream error each refusal must name) ---------
    ok("depth-1000", text=_flow_depth(1000)),
    ok("depth-json-10000", text=_flow_depth(9999)),
    refused("depth-json-10001", "max depth", text=_flow_depth(10000)),
    refused("depth-100000", "max depth", text=_bracket_depth(100_000)),
    ok("depth-indent-10000", text=_block_depth(9999)),
    refused("depth-indent-10001", "max depth", text=_block_depth(10000)),
    refused("billion-laughs", "excessive aliasing", text=BILLION_LAUGHS),
    ok("aliases-moderate", text=_aliases(20, 200)),
    ok("aliases-at-the-limit", text=_aliases(114, 1000)),
    refused("aliases-over-the-limit", "excessive aliasing", text=_aliases(115, 1000)),
    refused("alias-inside-its-anchor", "contains itself", text=_appended("x: &a [1, *a]\n")),
    refused("alias-unknown", "unknown anchor", text=_appended("x: *nowhere\n")),
    ok("anchor-redefined", text=_appended("a: &x 1\nb: &x 2\nc: *x\n")),
    ok("tagged-collections", text=_appended("x: !custom {a: !!set [1]}\n")),
    # a merge key's values win over the keys before it, as go-yaml merges in document order
    ok("merge-after-a-key", text=_raw('logLevel: ""', "logLevel: bogus") + MERGE_LOG_LEVEL),
    refused(
        "merge-before-a-key",
        "logLevel",
        text=MERGE_LOG_LEVEL + _raw('logLevel: ""', "logLevel: bogus"),
    ),
    refused("merge-of-a-scalar", "map merge", text=_appended("x: {<<: 1}\n")),
    # --- refused: what upstream's validation requires -----------------------------------------
    refused("no-secret-name", f"{OSC}.secretName", {f"{OSC}.secretName": _DELETE}),
    refused("empty-secret-name", f"{OSC}.secretName", {f"{OSC}.secretName": ""}),
    refused(
        "python-spelling",
        f"{OSC}.secretName",
        {f"{OSC}.secretName": _DELETE, f"{OSC}.secret_name": "x"},
    ),
    refused("no-version", VERSION, {VERSION: _DELETE}),
    refused("null-version", VERSION, {VERSION: None}),
    ConfigCase("version-too-old", _with({VERSION: "1.31.9"}), False, VERSION, None, True),
    refused("version-older", VERSION, {VERSION: "1.30.9"}),
    refused("version-too-new", VERSION, {VERSION: "1.37.0"}),
    refused("version-major-2", VERSION, {VERSION: "2.33.0"}),
    refused("version-not-semver", VERSION, {VERSION: "latest"}),
    refused("version-empty", VERSION, {VERSION: ""}),
    refused("version-prerelease-zero", VERSION, {VERSION: "1.33.0-01"}),
    refused(
        "version-yaml-number",
        VERSION,
        text=_raw("kubernetesVersion: 1.33.0", "kubernetesVersion: 1.33"),
    ),
    refused("sync-period-14s", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "14s"}),
    refused("sync-period-just-below", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "14.9999999s"}),
    refused("sync-period-zero", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "0s"}),
    refused("sync-period-negative", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "-10m"}),
    refused("sync-period-number", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": 600}),
    refused("sync-period-space", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "10 m"}),
    refused("sync-period-days", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "1d"}),
    refused("sync-period-empty", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": ""}),
    refused("sync-period-two-signs", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "--10m"}),
    refused("sync-period-overflow", f"{OSC}.syncPeriod", {f"{OSC}.syncPeriod": "3000000h"}),
    refused("token-sync-period", f"{TOKEN}.syncPeriod", {f"{TOKEN}.syncPeriod": "5s"}),
    refused("unit-check-sync-period", f"{CHECK}.syncPeriod", {f"{CHECK}.syncPeriod": "1s"}),
    refused("stuck-threshold", f"{CHECK}.stuckThreshold", {f"{CHECK}.stuckThreshold": "29s"}),
    refused(
        "sync-config-no-secret",
        f"{TOKEN}.syncConfigs[0].secretName",
        {f"{TOKEN}.syncConfigs": [{"path": "/var/lib/x/token"}]},
    ),
    refused(
        "sync-config-no-path",
        f"{TOKEN}.syncConfigs[1].path",
        {f"{TOKEN}.syncConfigs": [SYNC_A, {"secretName": "x"}]},
    ),
    refused(
        "sync-config-same-path",
        f"{TOKEN}.syncConfigs[1].path",
        {f"{TOKEN}.syncConfigs": [SYNC_A, {**SYNC_B, "path": SYNC_A["path"]}]},
    ),
    refused("log-level-warn", "logLevel", {"logLevel": "warn"}),
    refused("log-level-upper", "logLevel", {"logLevel": "INFO"}),
    refused("log-format-yaml", "logFormat", {"logFormat": "yaml"}),
    refused("feature-gate-unknown", "featureGates", {"featureGates": {"SomeFutureGate": True}}),
    refused(
        "feature-gate-gardener", "featureGates", {"featureGates": {"InPlaceNodeUpdates": True}}
    ),
    refused("feature-gate-string", "featureGates", {"featureGates": {"AllAlpha": "true"}}),
    refused("burst-negative", "clientConnection.burst", {"clientConnection.burst": -1}),
    refused("burst-string", "clientConnection.burst", {"clientConnection.burst": "5"}),
    refused("burst-int32-overflow", "clientConnection.burst", {"clientConnection.burst": 1 << 31}),
    refused("burst-fraction", "clientConnection.burst", {"clientConnection.burst": 1.5}),
    refused("qps-string", "clientConnection.qps", {"clientConnection.qps": "5"}),
    refused("qps-bool", "clientConnection.qps", {"clientConnection.qps": True}),
    refused("kubeconfig-number", "clientConnection.kubeconfig", {"clientConnection.kubeconfig": 5}),
    refused("port-string", "server.metrics.port", {"server.metrics": {"port": "2752"}}),
    refused("secret-name-number", f"{OSC}.secretName", {f"{OSC}.secretName": 42}),
    refused(
        "data-volume-string",
        "bootstrap.kubeletDataVolumeSize",
        {"bootstrap.kubeletDataVolumeSize": "64Gi"},
    ),
    refused(
        "debugging-string", "debugging.enableProfiling", {"debugging": {"enableProfiling": "true"}}
    ),
    refused("other-kind", "kind", {"kind": "ConfigMap"}),
    refused("other-api-version", "apiVersion", {"apiVersion": "v1"}),
    refused("api-version-number", "apiVersion", {"apiVersion": 5}),
    refused("not-a-mapping", "mapping", text="- 1\n"),
    refused("empty-file", "empty", text="\n"),
    refused("controllers-list", "controllers", {"controllers": [1]}),
    # --- the cluster CA: caBundle (up to v1.146, a Go []byte) or caFile (from v1.147 on) ------
    # each release ignores the other's field, as any field it does not know
    ok("ca-bundle-and-file", {"apiServer.caBundle": TEST_CA_BUNDLE}),
    ok("ca-bundle-empty", {"apiServer.caBundle": ""}),
    ok("ca-bundle-line-breaks", {"apiServer.caBundle": "LS0t\nLS0t\r\n"}),
    ok("ca-bundle-byte-list", {"apiServer.caBundle": [104, 105]}),
    ConfigCase(
        "ca-bundle-not-base64",
        _with({"apiServer.caBundle": "not base64!"}),
        True,
        "apiServer.caBundle",
        False,
    ),
    ConfigCase(
        "ca-bundle-unpadded",
        _with({"apiServer.caBundle": "TUlJQ"}),
        True,
        "apiServer.caBundle",
        False,
    ),
    ConfigCase(
        "ca-bundle-number", _with({"apiServer.caBundle": 42}), True, "apiServer.caBundle", False
    ),
    ConfigCase(
        "ca-bundle-byte-overflow",
        _with({"apiServer.caBundle": [256]}),
        True,
        "apiServer.caBundle",
        False,
    ),
    ConfigCase("ca-file-number", _with({"apiServer.caFile": 5}), False, "apiServer.caFile", True),
)
