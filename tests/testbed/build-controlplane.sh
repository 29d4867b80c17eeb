#!/bin/sh
# Builds kube-apiserver and etcd for the test bed, or reuses them from the cache.
# Output: the directory holding both binaries (printed on stdout, last line).
# The cache lives outside the repository and is keyed by the Kubernetes version;
# Go's own module and build caches are kept beside it so that removing the cache
# directory really starts from nothing.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
version=$(sed -n 's/^[[:space:]]*k8s.io\/kubernetes v\([0-9.]*\)$/\1/p' "$here/controlplane/go.mod")
[ -n "$version" ] || { echo "build-controlplane: cannot read the Kubernetes version from go.mod" >&2; exit 1; }
cache=${NODE_AGENT_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/node-agent-test}
out="$cache/controlplane-v$version"

if [ -x "$out/kube-apiserver" ] && [ -x "$out/etcd" ] && \
   cmp -s "$here/controlplane/go.mod" "$out/go.mod"; then
    echo "$out"
    exit 0
fi

command -v go >/dev/null 2>&1 || { echo "build-controlplane: Go is required to build the test control plane" >&2; exit 1; }
echo "build-controlplane: building kube-apiserver and etcd v$version into $out (first time takes minutes)" >&2
rm -rf "$out.tmp"
mkdir -p "$cache/go-mod" "$cache/go-build" "$cache/go-tmp" "$out.tmp"
export GOMODCACHE="$cache/go-mod" GOCACHE="$cache/go-build" GOTMPDIR="$cache/go-tmp" GOFLAGS=-mod=mod CGO_ENABLED=0
cd "$here/controlplane"
if [ ! -f go.sum ]; then go mod tidy >&2; fi
go build -trimpath -ldflags='-s -w' -o "$out.tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver >&2
go build -trimpath -ldflags='-s -w' -o "$out.tmp/etcd" go.etcd.io/etcd/server/v3 >&2
cp go.mod "$out.tmp/go.mod"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
