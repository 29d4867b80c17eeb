#!/bin/sh
# Build the self-contained node-agent artifact: a PyInstaller onedir bundle (CPython, its shared
# libraries and every dependency) that runs on a host without Python.
#
#   packaging/build.sh [OUT_DIR]        (default: dist/ in the source tree)
#
# Writes OUT_DIR/node-agent-<version>-linux-<arch>.tar.gz and its .sha256 (sha256sum format) and
# prints the tarball's path. <arch> is amd64 or arm64: this machine's, or NODE_AGENT_ARCH. The
# other architecture is built by this same script run inside a Debian 12 root file system of that
# architecture under qemu-user (packaging/rootfs.sh), with that Debian's python3.11; its build venv
# is made here, without emulation (foreign_venv below). Tar layout:
#   bin/node-agent -> ../lib/node-agent/node-agent   the entry point
#   bin/kubectl-node_agent -> the same               `kubectl node-agent` (the fleet view)
#   lib/node-agent/                                  the bundle (bootloader + _internal/)
#   VERSION
# The host must provide glibc and libsystemd.so.0 (every systemd host does); nothing else.
#
# Environment:
#   NODE_AGENT_VERSION      build the same sources as this version instead of __version__
#   NODE_AGENT_ARCH         amd64 or arm64 (default: this machine's architecture)
#   PYTHON                  CPython 3.11 built with --enable-shared (default: python3); for the
#                           other architecture, the root file system's python3.11
#   NODE_AGENT_BUILD_CACHE  where build venvs and finished artifacts are kept
#                           (default: $NODE_AGENT_TEST_CACHE/artifact, else ~/.cache/node-agent-test/artifact)
# A finished artifact is reused while its key is unchanged: the hash of the agent's sources, the
# lock file, the packaging files, the unit file and the interpreter's version (for the other
# architecture, under a cache directory of its own root file system). The build venv is reused
# while the lock and the interpreter are unchanged.
#
# CI and the Containerfile both run this script; CI has no container engine, so building and
# testing the artifact through this script in `make test` is what keeps the Containerfile honest.
set -eu

src=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$src/dist}
python=${PYTHON:-python3}
cache=${NODE_AGENT_BUILD_CACHE:-${NODE_AGENT_TEST_CACHE:-$HOME/.cache/node-agent-test}/artifact}

die() {
    echo "packaging/build.sh: $*" >&2
    exit 1
}

case $(uname -m) in
    x86_64) native=amd64 ;;
    aarch64) native=arm64 ;;
    *) die "only linux-amd64 and linux-arm64 are built (this machine is $(uname -m))" ;;
esac
arch=${NODE_AGENT_ARCH:-$native}
case $arch in amd64 | arm64) ;; *) die "bad NODE_AGENT_ARCH $arch (amd64 or arm64)" ;; esac
case $arch in amd64) qemu_arch=x86_64 ;; arm64) qemu_arch=aarch64 ;; esac  # the GNU name
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$src/node_agent/__init__.py")
[ -n "$version" ] || die "no __version__ in node_agent/__init__.py"
if [ -n "${NODE_AGENT_VERSION:-}" ] && [ "$NODE_AGENT_VERSION" != "$version" ]; then
    # The same sources under another version (the tests' second image for self-update): a copy
    # of the tree with __version__ replaced, built by its own copy of this script.
    case $NODE_AGENT_VERSION in *[!0-9A-Za-z.+-]*) die "bad NODE_AGENT_VERSION" ;; esac
    copy=$(mktemp -d "${TMPDIR:-/tmp}/node-agent-src.XXXXXX")
    trap 'rm -rf "$copy"' EXIT INT TERM
    (cd "$src" && tar -cf - node_agent pyproject.toml packaging systemd) | tar -C "$copy" -xf -
    sed -i "s/^__version__ = \".*\"$/__version__ = \"$NODE_AGENT_VERSION\"/" \
        "$copy/node_agent/__init__.py"
    NODE_AGENT_VERSION='' sh "$copy/packaging/build.sh" "$out"
    exit $?
fi
if [ "$arch" = "$native" ]; then
    pyinfo=$("$python" - < "$src/packaging/pyinfo.py") || die "unusable interpreter $python"
else
    rootfs=$(sh "$src/packaging/rootfs.sh" "$arch") || die "no $arch root file system"
    pyinfo=$(cat "$rootfs/.node-agent-pyinfo")
    cache=$cache/$arch-${rootfs##*-}
fi

name=node-agent-$version-linux-$arch
lock_key=$(sha256sum < "$src/packaging/requirements.lock" | cut -c1-16)
py_key=$(printf '%s' "$pyinfo" | sha256sum | cut -c1-8)
src_key=$(
    cd "$src"
    {
        find node_agent -name '*.py' -type f
        echo pyproject.toml packaging/build.sh packaging/entry.py packaging/node-agent.spec \
            packaging/pyinfo.py packaging/requirements.lock systemd/node-agent.service | tr ' ' '\n'
    } | LC_ALL=C sort | while read -r f; do
        printf '%s %s\n' "$f" "$(sha256sum < "$f" | cut -d' ' -f1)"
    done | { cat; echo "$pyinfo"; } | sha256sum | cut -c1-16
)
done_dir=$cache/builds/$version-$src_key
venv=$cache/venv-$lock_key-$py_key

mkdir -p "$out" "$cache/builds"
if [ -f "$done_dir/$name.tar.gz" ] && [ -f "$done_dir/$name.tar.gz.sha256" ]; then
    cp "$done_dir/$name.tar.gz" "$done_dir/$name.tar.gz.sha256" "$out/"
    echo "$out/$name.tar.gz"
    exit 0
fi

# One package's pin and hashes from the lock (its line and the continuation lines after it).
lock_entry() {
    awk -v want="$1==" 'index($0, want) == 1 { p = 1 } p { print } p && !/\\$/ { exit }' \
        "$src/packaging/requirements.lock"
}

# The build venv of the other architecture, made on this machine into $1 (renamed to $venv when
# complete). Emulated, pip and the compile took ~7 CPU-minutes, 4 of them pystemd's C; here under a
# minute:
# - pystemd has no wheel for arm64: its hash-checked sdist is built into a wheel by Debian's cross
#   compiler against the root file system (its Python headers, its libsystemd), setuptools reading
#   the target interpreter's build settings (its _sysconfigdata) instead of this one's;
# - this machine's pip installs the lock's wheels for the target platform (CPython 3.11, manylinux
#   up to the root's glibc), that wheel with them under its own hash: every file hash-checked;
# - the venv around them is written as PEP 405 lays it out (pyvenv.cfg, bin/python pointing at the
#   root's /usr/bin/python3.11), so nothing runs under emulation before PyInstaller.
foreign_venv() {
    into=$1
    triplet=$qemu_arch-linux-gnu
    command -v "$triplet-gcc" > /dev/null \
        || die "$triplet-gcc missing (Debian package gcc-$(echo "$triplet" | tr _ -))"
    glibc_minor=$(sed -n 's/^#define[[:space:]]*__GLIBC_MINOR__[[:space:]]*\([0-9]*\)$/\1/p' \
        "$rootfs/usr/include/features.h")
    [ -n "$glibc_minor" ] || die "no glibc version in $rootfs/usr/include/features.h"
    sysdata=_sysconfigdata__linux_$triplet
    [ -f "$rootfs/usr/lib/python3.11/$sysdata.py" ] || die "no $sysdata.py in $rootfs"
    scratch=$into.scratch
    mkdir -p "$scratch/sysconfig" "$scratch/wheels"
    cp "$rootfs/usr/lib/python3.11/$sysdata.py" "$scratch/sysconfig/"
    # A host venv with the lock's setuptools, the sdist's build backend (its .c files are shipped:
    # Cython is not needed).
    "$python" -m venv --without-pip "$scratch/host"
    lock_entry setuptools > "$scratch/setuptools.lock"
    lock_entry pystemd > "$scratch/pystemd.lock"
    "$python" -m pip --python "$scratch/host/bin/python" install -q --disable-pip-version-check \
        --no-deps --require-hashes -r "$scratch/setuptools.lock" >&2 || die "no setuptools for pystemd"
    env _PYTHON_HOST_PLATFORM="linux-$qemu_arch" _PYTHON_SYSCONFIGDATA_NAME="$sysdata" \
        PYTHONPATH="$scratch/sysconfig" CC="$triplet-gcc --sysroot=$rootfs" \
        CPPFLAGS="-I$rootfs/usr/include/python3.11" \
        PKG_CONFIG_LIBDIR="$rootfs/usr/lib/$triplet/pkgconfig:$rootfs/usr/share/pkgconfig" \
        PKG_CONFIG_SYSROOT_DIR="$rootfs" \
        "$python" -m pip --python "$scratch/host/bin/python" wheel -q --no-cache-dir --disable-pip-version-check \
        --no-build-isolation --no-deps --require-hashes -w "$scratch/wheels" -r "$scratch/pystemd.lock" >&2 \
        || die "cross-compiling pystemd for $arch failed"
    wheel=$(echo "$scratch"/wheels/pystemd-*-linux_"$qemu_arch".whl)
    [ -f "$wheel" ] || die "no pystemd wheel for linux_$qemu_arch"
    {
        awk '/^pystemd==/ { s = 1; next } s && /^ +--hash/ { next } { s = 0; print }' \
            "$src/packaging/requirements.lock"
        printf '%s --hash=sha256:%s\n' "$wheel" "$(sha256sum < "$wheel" | cut -d' ' -f1)"
    } > "$scratch/requirements.lock"
    platforms="--platform linux_$qemu_arch --platform manylinux2014_$qemu_arch"
    minor=17
    while [ "$minor" -le "$glibc_minor" ]; do
        platforms="$platforms --platform manylinux_2_${minor}_$qemu_arch"
        minor=$((minor + 1))
    done
    # shellcheck disable=SC2086 # $platforms: our own words
    "$python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
        --only-binary=:all: --implementation cp --python-version 3.11 --abi cp311 $platforms \
        --target "$into/lib/python3.11/site-packages" -r "$scratch/requirements.lock" >&2 \
        || die "installing the lock for $arch failed"
    rm -rf "$into/lib/python3.11/site-packages/bin"  # scripts for this machine's interpreter
    mkdir -p "$into/bin"
    ln -s lib "$into/lib64"
    for exe in python python3 python3.11; do ln -s /usr/bin/python3.11 "$into/bin/$exe"; done
    printf 'home = /usr/bin\ninclude-system-site-packages = false\nversion = %s\n' \
        "${pyinfo%% *}" > "$into/pyvenv.cfg"
    rm -rf "$scratch"
    touch "$into/.complete"
}

if [ "$arch" != "$native" ]; then
    # This script again, inside the root file system under emulation, on a copy of the sources:
    # there it is the machine's own architecture. Its cache (and so the finished artifact under
    # the key computed above, and the venv made here beforehand) is this one, mounted at /build.
    work=$(mktemp -d "$cache/work.XXXXXX")
    trap 'rm -rf "$work"' EXIT INT TERM
    mkdir "$work/src" "$work/out"
    if [ ! -f "$venv/.complete" ]; then
        echo "packaging/build.sh: creating the $arch build venv $venv" >&2
        foreign_venv "$work/venv"
        rm -rf "$venv"  # an incomplete one
        # another build may have finished the same venv meanwhile: then it is used
        mv -T "$work/venv" "$venv" 2> /dev/null || [ -f "$venv/.complete" ] || die "cannot create $venv"
    fi
    (cd "$src" && tar -cf - node_agent pyproject.toml packaging systemd) | tar -C "$work/src" -xf -
    inner=/build/${work##*/}
    pass=""
    for var in PIP_CERT PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT \
        http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
        eval "value=\${$var:-}"
        [ -z "$value" ] || pass="$pass $var=$value"
    done
    echo "packaging/build.sh: building $name under emulation in $rootfs" >&2
    # A private mount namespace: the mounts go with it, whatever happens.
    # shellcheck disable=SC2086,SC2016 # $pass: NAME=value words without spaces; the script is sh -c's
    unshare --mount --propagation private sh -euc '
        root=$1 cache=$2 inner=$3
        shift 3
        mount --rbind /dev "$root/dev"
        mount -t proc proc "$root/proc"
        mount -t tmpfs tmpfs "$root/tmp"
        mount --bind "$cache" "$root/build"
        # name resolution and the CAs that reach the package index, as on this machine
        mkdir -p "$root/etc/ssl/certs"
        mount --bind /etc/ssl/certs "$root/etc/ssl/certs"
        touch "$root/etc/resolv.conf"
        mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
        if [ -f /etc/pip.conf ]; then
            touch "$root/etc/pip.conf"
            mount --bind /etc/pip.conf "$root/etc/pip.conf"
        fi
        exec chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp LC_ALL=C.UTF-8 "$@" \
            PYTHON=/usr/bin/python3.11 NODE_AGENT_BUILD_CACHE=/build \
            sh "$inner/src/packaging/build.sh" "$inner/out"
    ' sh "$rootfs" "$cache" "$inner" $pass >&2 || die "the $arch build under emulation failed"
    [ -f "$done_dir/$name.tar.gz" ] || die "the $arch build did not arrive under its key $src_key"
    cp "$done_dir/$name.tar.gz" "$done_dir/$name.tar.gz.sha256" "$out/"
    echo "$out/$name.tar.gz"
    exit 0
fi

if [ ! -f "$venv/.complete" ]; then
    echo "packaging/build.sh: creating build venv $venv" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes \
        -r "$src/packaging/requirements.lock"
    touch "$venv/.complete"
fi

work=$(mktemp -d "$cache/work.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
echo "packaging/build.sh: building $name (key $src_key)" >&2
NODE_AGENT_SRC=$src "$venv/bin/python" -m PyInstaller --noconfirm --clean --log-level WARN \
    --workpath "$work/build" --distpath "$work/dist" "$src/packaging/node-agent.spec" >&2

tree=$work/tree
mkdir -p "$tree/bin" "$tree/lib"
mv "$work/dist/node-agent" "$tree/lib/node-agent"
ln -s ../lib/node-agent/node-agent "$tree/bin/node-agent"
# kubectl runs `kubectl node-agent` as kubectl-node_agent: the same program, told by its name.
ln -s ../lib/node-agent/node-agent "$tree/bin/kubectl-node_agent"
echo "$version" > "$tree/VERSION"
got=$("$tree/bin/node-agent" version) || die "the built binary does not run"
[ "$got" = "node-agent $version" ] || die "the built binary reports '$got', expected $version"

# Same inputs, same bytes: fixed order, owners and times, no gzip timestamp.
tar -C "$tree" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . \
    | gzip -9n > "$work/$name.tar.gz"
(cd "$work" && sha256sum "$name.tar.gz" > "$name.tar.gz.sha256")
mkdir "$work/done"
cp "$work/$name.tar.gz" "$work/$name.tar.gz.sha256" "$work/done/"
rm -rf "$done_dir"
mv -T "$work/done" "$done_dir"  # complete or absent, never half-copied
# Keep the five newest builds.
# shellcheck disable=SC2012 # our own directory names: no odd characters
ls -1dt "$cache"/builds/*/ | tail -n +6 | while read -r old; do rm -rf "$old"; done
cp "$work/$name.tar.gz" "$work/$name.tar.gz.sha256" "$out/"
echo "$out/$name.tar.gz"
