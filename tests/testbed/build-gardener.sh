#!/bin/sh
# Builds Gardener's side of the test bed for one Gardener release, or reuses it from the cache:
# gardener-gen (renders what Gardener's own code sends to a node, see gardener/main.go) and
# upstream gardener-node-agent (the reference twin of node-agent).
#
#   build-gardener.sh [<version>]      default: the newest release of gardener/releases
#   build-gardener.sh --list           the releases the bed serves, oldest first
#
# The wrapper module's go.mod is rendered for the release (the two Gardener modules at that
# version; `go mod tidy` takes every other module at the version Gardener's own go.mod asks
# for). Output: the directory holding the binaries (printed on stdout, last line),
# gardener-<version> in the cache, keyed by the wrapper's sources; it shares Go's module and
# build caches with build-controlplane.sh.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
releases="$here/gardener/releases"
if [ "${1:-}" = "--list" ]; then
    grep -v '^[[:space:]]*\(#\|$\)' "$releases"
    exit 0
fi
version=${1:-$(grep -v '^[[:space:]]*\(#\|$\)' "$releases" | tail -n 1)}
grep -qx "$version" "$releases" || {
    echo "build-gardener: $version is not a release of $releases" >&2
    exit 1
}
cache=${NODE_AGENT_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/node-agent-test}
out="$cache/gardener-$version"
binaries="gardener-gen gardener-node-agent"
sources="main.go tools.go"

# The go.mod of the wrapper module for $version (tidied during the build).
render_go_mod() {
    cat <<EOF
// Rendered by build-gardener.sh for Gardener $version.
module node-agent.test/gardener

go 1.26

require (
	github.com/gardener/gardener $version
	github.com/gardener/gardener/pkg/apis $version
)
EOF
}

cached() {
    for b in $binaries; do [ -x "$out/$b" ] || return 1; done
    for s in $sources; do cmp -s "$here/gardener/$s" "$out/src/$s" || return 1; done
    render_go_mod | cmp -s - "$out/src/go.mod.in"
}

if cached; then
    echo "$out"
    exit 0
fi

command -v go >/dev/null 2>&1 || { echo "build-gardener: Go is required to build Gardener's test binaries" >&2; exit 1; }
mkdir -p "$cache"
# One build per release at a time: test runs started side by side wait for the first one's build.
exec 9>"$cache/.gardener-$version.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if cached; then
    echo "$out"
    exit 0
fi

# shellcheck source=tests/testbed/go-env.sh
. "$here/go-env.sh"
echo "build-gardener: building $binaries $version into $out (first time takes minutes)" >&2
rm -rf "$out.tmp"
mkdir -p "$out.tmp/src"
for s in $sources; do cp "$here/gardener/$s" "$out.tmp/src/$s"; done
render_go_mod > "$out.tmp/src/go.mod.in"
cp "$out.tmp/src/go.mod.in" "$out.tmp/src/go.mod"
cd "$out.tmp/src"
go mod tidy >&2

# As Gardener's hack/get-build-ld-flags.sh stamps its binaries: gardener-node-agent reads
# config-<gitVersion>.yaml, and gardener-gen names that file and the agent's image tag after it.
major=$(echo "$version" | sed 's/^v\([0-9]*\)\..*/\1/')
minor=$(echo "$version" | sed 's/^v[0-9]*\.\([0-9]*\)\..*/\1/')
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version"
ldflags="$ldflags -X k8s.io/component-base/version.gitMajor=$major -X k8s.io/component-base/version.gitMinor=$minor"
ldflags="$ldflags -X k8s.io/component-base/version.gitTreeState=clean"

go build -trimpath -ldflags="$ldflags" -o "$out.tmp/gardener-node-agent" github.com/gardener/gardener/cmd/gardener-node-agent >&2
go build -trimpath -ldflags="$ldflags" -o "$out.tmp/gardener-gen" . >&2
cd "$cache"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
