#!/bin/sh
# Builds Gardener's side of the test bed from the Gardener release pinned in gardener/go.mod, or
# reuses it from the cache: gardener-gen (renders what Gardener's own code sends to a node, see
# gardener/main.go) and upstream gardener-node-agent (the reference twin of node-agent).
# Output: the directory holding the binaries (printed on stdout, last line). The cache is keyed
# by the Gardener version and the wrapper's sources; it shares Go's module and build caches
# with build-controlplane.sh.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's/^[[:space:]]*github.com\/gardener\/gardener \(v[0-9.]*\)$/\1/p' "$here/gardener/go.mod")
[ -n "$version" ] || { echo "build-gardener: cannot read the Gardener version from go.mod" >&2; exit 1; }
cache=${NODE_AGENT_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/node-agent-test}
out="$cache/gardener-$version"
binaries="gardener-gen gardener-node-agent"
sources="go.mod main.go"

cached() {
    for b in $binaries; do [ -x "$out/$b" ] || return 1; done
    for s in $sources; do cmp -s "$here/gardener/$s" "$out/$s" || return 1; done
}

if cached; then
    echo "$out"
    exit 0
fi

command -v go >/dev/null 2>&1 || { echo "build-gardener: Go is required to build Gardener's test binaries" >&2; exit 1; }
mkdir -p "$cache"
# One build at a time: test runs started side by side wait for the first one's build.
exec 9>"$cache/.gardener-$version.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if cached; then
    echo "$out"
    exit 0
fi

mkdir -p "$cache/go-mod" "$cache/go-build" "$cache/go-tmp"
export GOMODCACHE="$cache/go-mod" GOCACHE="$cache/go-build" GOTMPDIR="$cache/go-tmp" GOFLAGS=-mod=mod CGO_ENABLED=0
cd "$here/gardener"
if [ ! -f go.sum ]; then go mod tidy >&2; fi

# As Gardener's hack/get-build-ld-flags.sh stamps its binaries: gardener-node-agent reads
# config-<gitVersion>.yaml, and gardener-gen names that file and the agent's image tag after it.
major=$(echo "$version" | sed 's/^v\([0-9]*\)\..*/\1/')
minor=$(echo "$version" | sed 's/^v[0-9]*\.\([0-9]*\)\..*/\1/')
ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$version"
ldflags="$ldflags -X k8s.io/component-base/version.gitMajor=$major -X k8s.io/component-base/version.gitMinor=$minor"
ldflags="$ldflags -X k8s.io/component-base/version.gitTreeState=clean"

echo "build-gardener: building $binaries $version into $out (first time takes minutes)" >&2
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
go build -trimpath -ldflags="$ldflags" -o "$out.tmp/gardener-gen" . >&2
go build -trimpath -ldflags="$ldflags" -o "$out.tmp/gardener-node-agent" github.com/gardener/gardener/cmd/gardener-node-agent >&2
for s in $sources; do cp "$s" "$out.tmp/$s"; done
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
