#!/bin/sh
# A Debian 12 root file system of another architecture, run through qemu-user (binfmt_misc): where
# packaging/build.sh builds the artifact of an architecture this machine is not, and what the
# test bed's node of that architecture takes its containerd and shared libraries from.
#
#   packaging/rootfs.sh ARCH          (arm64 on an amd64 machine, or amd64 on an arm64 one)
#
# Prints the root's path. Cached under $NODE_AGENT_BUILD_CACHE (default
# $NODE_AGENT_TEST_CACHE/artifact) as rootfs-<arch>-<key>, the key being the hash of the package
# list, the suite and its sources, packaging/pyinfo.py and $recipe; the two newest are kept.
#
# mmdebstrap's extract variant: the packages and their dependencies are unpacked, no maintainer
# script runs. Nothing here needs one (no users, services or alternatives: python3.11 and gcc are
# files of their packages), and running dpkg's scripts under emulation took over ten minutes
# where the extraction takes under one.
#
# Every call also makes sure the kernel runs the architecture's binaries: binfmt_misc mounted and
# Debian's qemu-user-static interpreter registered with the F flag (opened once at registration,
# so it works in chroots and in the test bed's mount namespaces alike).
set -eu

arch=${1:-}
src=$(cd "$(dirname "$0")/.." && pwd)
cache=${NODE_AGENT_BUILD_CACHE:-${NODE_AGENT_TEST_CACHE:-$HOME/.cache/node-agent-test}/artifact}

die() {
    echo "packaging/rootfs.sh: $*" >&2
    exit 1
}

case $arch in
    arm64) qemu=aarch64 ;;
    amd64) qemu=x86_64 ;;
    *) die "usage: rootfs.sh arm64|amd64" ;;
esac

# The build's (python3.11 with its shared libpython, gcc and the headers pystemd compiles
# against, libzstd.a for the launcher, the tools build.sh runs) and the test node's (containerd
# and ctr, glibc, libsystemd0).
packages="bash binutils containerd coreutils dash findutils gcc grep gzip libc-bin libc6-dev \
libpython3.11 libsystemd-dev libzstd-dev pkg-config python3.11 python3.11-dev python3.11-venv sed tar"
suite=bookworm
# How the root is made, for the key: change it with the mmdebstrap call or the steps after it.
recipe="mmdebstrap-extract ldconfig pyinfo build-dir v1"
sources="deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main"

ensure_binfmt() {
    dir=/proc/sys/fs/binfmt_misc
    [ -e "$dir/status" ] || mount -t binfmt_misc binfmt_misc "$dir" \
        || die "cannot mount binfmt_misc on $dir"
    entry=$dir/qemu-$qemu
    if ! [ -e "$entry" ]; then
        # Installed while binfmt_misc was not mounted (a container, a fresh boot): register it.
        command -v update-binfmts > /dev/null || die "update-binfmts missing (binfmt-support)"
        update-binfmts --import "qemu-$qemu" > /dev/null 2>&1 || true
        update-binfmts --enable "qemu-$qemu" > /dev/null 2>&1 || true
    fi
    [ -e "$entry" ] || die "no binfmt_misc entry qemu-$qemu (install qemu-user-static)"
    [ "$(head -n 1 "$entry")" = enabled ] || echo 1 > "$entry"
    grep -q '^flags: .*F' "$entry" || die "$entry lacks the F flag (Debian's qemu-user-static sets it)"
}

ensure_binfmt
key=$(
    {
        printf '%s\n' "$arch" "$suite" "$packages" "$sources" "$recipe"
        sha256sum < "$src/packaging/pyinfo.py"
    } | sha256sum | cut -c1-16
)
root=$cache/rootfs-$arch-$key
if [ -f "$root/.node-agent-pyinfo" ]; then
    echo "$root"
    exit 0
fi

command -v mmdebstrap > /dev/null || die "mmdebstrap missing (Debian package mmdebstrap)"
mkdir -p "$cache"
tmp=$(mktemp -d "$cache/rootfs-tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
echo "packaging/rootfs.sh: creating the $arch root file system (key $key)" >&2
# shellcheck disable=SC2086 # the package list is ours, one word each
mmdebstrap --quiet --mode=root --arch="$arch" --variant=extract \
    --include="$(echo $packages | tr ' ' ,)" "$suite" "$tmp/root" "$sources" >&2 \
    || die "mmdebstrap failed"
mkdir -p "$tmp/root/build"
# The loader's cache, as dpkg's trigger would have written it (PyInstaller reads `ldconfig -p`).
chroot "$tmp/root" /sbin/ldconfig || die "ldconfig failed in the $arch root file system"
# The interpreter's identity, for the build's cache keys (read without emulation from then on).
chroot "$tmp/root" /usr/bin/python3.11 - < "$src/packaging/pyinfo.py" > "$tmp/root/.node-agent-pyinfo" \
    || die "the $arch python3.11 does not run under emulation"
mv -T "$tmp/root" "$root" 2> /dev/null || [ -f "$root/.node-agent-pyinfo" ] || die "cannot create $root"
# Keep the two newest, and the builds made in them (packaging/build.sh's $cache/<arch>-<key>).
# shellcheck disable=SC2012 # our own directory names: no odd characters
ls -1dt "$cache"/rootfs-"$arch"-*/ | tail -n +3 | while read -r old; do
    old=${old%/}
    rm -rf "$old" "$cache/$arch-${old##*-}"
done
echo "$root"
