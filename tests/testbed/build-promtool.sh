#!/bin/sh
# Builds promtool (Prometheus' rule checker and rule unit-test runner) for the monitoring
# mixin's tests, or reuses it from the cache. Output: the path of the binary (stdout, last line).
# Built like the control plane (build-controlplane.sh): from Prometheus' Go module at the exact
# version pinned in tests/testbed/promtool/go.mod, sharing the cache's Go module and build
# caches, keyed by that version. The service-discovery plugins are left out (build tag
# remove_all_sd): promtool's rule commands do not use them, and the build is much smaller.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's/^require github.com\/prometheus\/prometheus \(v[0-9.]*\)$/\1/p' "$here/promtool/go.mod")
[ -n "$version" ] || { echo "build-promtool: cannot read the Prometheus version from go.mod" >&2; exit 1; }
cache=${NODE_AGENT_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/node-agent-test}
out="$cache/promtool-$version"

built() {
    [ -x "$out/promtool" ] && cmp -s "$here/promtool/go.mod" "$out/go.mod"
}

if built; then
    echo "$out/promtool"
    exit 0
fi

command -v go >/dev/null 2>&1 || { echo "build-promtool: Go is required to build promtool" >&2; exit 1; }
mkdir -p "$cache"
exec 9>"$cache/.promtool-$version.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if built; then
    echo "$out/promtool"
    exit 0
fi

# shellcheck source=tests/testbed/go-env.sh
. "$here/go-env.sh"
cd "$here/promtool"
echo "build-promtool: building promtool $version into $out (first time takes minutes)" >&2
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
go build -trimpath -tags remove_all_sd -ldflags='-s -w' -o "$out.tmp/promtool" \
    github.com/prometheus/prometheus/cmd/promtool >&2
cp go.mod "$out.tmp/go.mod"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out/promtool"
