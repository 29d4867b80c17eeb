#!/bin/sh
# Builds the test bed's Kubernetes binaries, or reuses them from the cache: with no argument
# (or "controlplane") kube-apiserver, kube-controller-manager and etcd; with "kubelet-<version>"
# the real kubelet at the Kubernetes version of tests/testbed/kubelet-<version>/go.mod (a Gardener
# shape's, which the control plane's version-skew policy allows), for linux/amd64 or, with a second
# argument "arm64", cross-built for linux/arm64 (the emulated arm64 node's; Go alone, no cgo).
# The kubelet at the control plane's own version has no module of its own: it is built from the
# control plane's (one module graph, so after the control plane Go's build cache holds most of
# its packages: 42 s of CPU instead of 517 s).
# Output: the directory holding the binaries
# (printed on stdout, last line). The cache lives outside the repository and is keyed by the
# module and its Kubernetes version; Go's own module and build caches are kept beside it so that
# removing the cache directory really starts from nothing. A cache directory from before
# kube-controller-manager was part of the bed is extended in place rather than rebuilt.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
module=${1:-controlplane}
arch=${2:-amd64}
case $module in
    controlplane) binaries="kube-apiserver kube-controller-manager etcd" ;;
    kubelet-*) binaries="kubelet" ;;
    *) echo "build-controlplane: unknown module $module (controlplane or kubelet-<version>)" >&2; exit 2 ;;
esac
case $module:$arch in
    *:amd64 | kubelet-*:arm64) ;;
    *) echo "build-controlplane: $module is not built for $arch (kubelets only: amd64 or arm64)" >&2; exit 2 ;;
esac
dir="$here/$module"
[ -d "$dir" ] || dir="$here/controlplane"
version=$(sed -n 's/^[[:space:]]*k8s.io\/kubernetes v\([0-9.]*\)$/\1/p;s/^require k8s.io\/kubernetes v\([0-9.]*\)$/\1/p' "$dir/go.mod")
[ -n "$version" ] || { echo "build-controlplane: cannot read the Kubernetes version from $dir/go.mod" >&2; exit 1; }
case $module in
    controlplane | "kubelet-$version") ;;
    *) echo "build-controlplane: no module for $module (tests/testbed/$module, or the control plane's kubelet-$version)" >&2; exit 2 ;;
esac
cache=${NODE_AGENT_TEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/node-agent-test}
# the linux/amd64 builds keep their first directory name; the others carry their architecture
suffix=""
[ "$arch" = amd64 ] || suffix="-$arch"
out="$cache/${module%%-*}-v$version$suffix"

cached() {
    for b in $binaries; do [ -x "$out/$b" ] || return 1; done
    cmp -s "$dir/go.mod" "$out/go.mod"
}

if cached; then
    echo "$out"
    exit 0
fi

command -v go >/dev/null 2>&1 || { echo "build-controlplane: Go is required to build the test control plane" >&2; exit 1; }
mkdir -p "$cache"
# One build at a time: test runs started side by side wait for the first one's build.
exec 9>"$cache/.${module%%-*}-v$version$suffix.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi
if cached; then
    echo "$out"
    exit 0
fi

# shellcheck source=tests/testbed/go-env.sh
. "$here/go-env.sh"
export GOOS=linux GOARCH="$arch"
cd "$dir"
if [ ! -f go.sum ]; then go mod tidy >&2; fi

# The kubelet reports its version to the API server (the Node's nodeInfo.kubeletVersion), so
# it carries the release's, as Kubernetes' own build stamps it; the control plane's binaries
# keep the module build's placeholder (nothing in the bed reads their version).
stamp=""
if [ "$binaries" = kubelet ]; then
    minor=$(echo "$version" | cut -d. -f2)
    pkg=k8s.io/component-base/version
    stamp="-X $pkg.gitVersion=v$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
fi

build() { # build <binary> <package> <dir>
    go build -trimpath -ldflags="-s -w $stamp" -o "$3/$1.tmp" "$2" >&2
    mv "$3/$1.tmp" "$3/$1"
}
package() {
    case $1 in
        etcd) echo go.etcd.io/etcd/server/v3 ;;
        *) echo "k8s.io/kubernetes/cmd/$1" ;;
    esac
}

if cmp -s go.mod "$out/go.mod" 2>/dev/null; then
    # Same module, some binaries missing: add only those.
    for b in $binaries; do
        [ -x "$out/$b" ] && continue
        echo "build-controlplane: adding $b v$version to $out" >&2
        build "$b" "$(package "$b")" "$out"
    done
    echo "$out"
    exit 0
fi

echo "build-controlplane: building $binaries v$version (linux/$arch) into $out (first time takes minutes)" >&2
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
for b in $binaries; do
    build "$b" "$(package "$b")" "$out.tmp"
done
cp go.mod "$out.tmp/go.mod"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out"
