"""Build the node-agent OCI image: one single-file executable per platform, no container daemon.

    .venv/bin/python packaging/image.py [OUT_DIR]        (default: dist/ in the source tree)

For linux/amd64 and linux/arm64: runs packaging/build.sh (cached) for that architecture's onedir
artifact, compiles packaging/launcher.c for it (the other architecture's with Debian's cross
compiler, zstd's decoder from packaging/rootfs.sh's root file system) and appends the bundle
(``lib/node-agent/`` of the artifact) to it as a payload with a trailer (see launcher.c).
Writes to OUT_DIR:

    node-agent-<version>-linux-amd64.bin     the single files (what the image carries)
    node-agent-<version>-linux-arm64.bin
    node-agent-<version>-image.oci.tar       an OCI image layout whose index.json names one
                                             image index (ref name <version>) of two manifests,
                                             linux/amd64 and linux/arm64, each one gzip layer
                                             with /gardener-node-agent (0755) and
                                             /ko-app/gardener-node-agent (hard link to it),
                                             Entrypoint ["/gardener-node-agent"]

and prints the layout's path. Same inputs, same bytes (fixed order, owners and times, gzip
without a timestamp), so the same index digest. Finished images are kept under
``$NODE_AGENT_BUILD_CACHE/images`` keyed by the artifacts' sha256, the launcher, this script
and the compilers (and the other architecture's libzstd.a).

``NODE_AGENT_IMAGE_ARCHES="amd64"`` builds an index of that platform alone, for a test that
needs no other (an arm64 build of new sources takes minutes under emulation).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

SRC = Path(__file__).resolve().parent.parent
LAUNCHER_C = SRC / "packaging" / "launcher.c"
BUNDLE_PREFIX = "lib/node-agent/"
IMAGE_FILE = "gardener-node-agent"
KO_FILE = "ko-app/gardener-node-agent"
#: the image's platforms, in the index's order
ARCHES = ("amd64", "arm64")
#: Debian's multiarch triplet (and cross compiler prefix) of each
TRIPLETS = {"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}

MAGIC = b"NAGENTX1"
FORMAT = 1
ZSTD = 1  # the trailer's compression field: one zstd frame (the only kind the launcher takes)
#: zstd's level for the payload: the strongest, as it is paid once per build (cached) and
#: decompression speed hardly depends on it
ZSTD_LEVEL = 19
ENTRY = struct.Struct("<BBHHHQ")  # type, 0, mode, path length, 0, size
TRAILER = struct.Struct("<8sIIQQ32s")  # magic, format, compression, offset, length, sha256

INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"


def _die(message: str) -> None:
    print(f"packaging/image.py: {message}", file=sys.stderr)
    raise SystemExit(1)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def native_arch() -> str:
    """This machine's architecture in OCI's words."""
    machine = platform.machine()
    found = {"x86_64": "amd64", "aarch64": "arm64"}.get(machine)
    if found is None:
        raise SystemExit(f"packaging/image.py: unsupported machine {machine}")
    return found


def rootfs(arch: str) -> Path:
    """packaging/rootfs.sh's root file system of ``arch`` (cached; also sets up binfmt_misc)."""
    found = subprocess.run(
        ["sh", str(SRC / "packaging" / "rootfs.sh"), arch],
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        _die(f"no {arch} root file system (packaging/rootfs.sh)")
    return Path(found.stdout.strip().splitlines()[-1])


# -- the single file --------------------------------------------------------------------------
def compiler(arch: str) -> tuple[list[str], list[str]]:
    """The compiler of ``arch`` and how it links zstd's decoder statically: this machine's gcc
    with libzstd-dev, or Debian's cross gcc with the root file system's libzstd.a and zstd.h
    (searched after the cross compiler's own headers)."""
    if arch == native_arch():
        return ["gcc"], ["-l:libzstd.a"]
    root = rootfs(arch)
    libzstd = root / "usr" / "lib" / TRIPLETS[arch] / "libzstd.a"
    return [f"{TRIPLETS[arch]}-gcc", "-idirafter", str(root / "usr" / "include")], [str(libzstd)]


def compile_launcher(out: Path, arch: str | None = None) -> None:
    """gcc, optimised and stripped; no paths of the build machine end up in the binary. zstd's
    decoder is linked in statically: the launcher runs before anything else and needs only
    glibc (libzstd-dev at build time)."""
    cc, zstd = compiler(arch or native_arch())
    subprocess.run(
        [*cc, "-std=gnu11", "-O2", "-s", "-Wall", "-Wextra", "-Werror",
         f"-ffile-prefix-map={LAUNCHER_C.parent}=.", "-o", str(out), str(LAUNCHER_C), *zstd],
        check=True,
    )  # fmt: skip


def payload_entry(kind: bytes, path: str, mode: int, data: bytes) -> bytes:
    """One payload entry: ``kind`` b"d" (directory), b"f" (file) or b"l" (symlink; data is the
    target)."""
    name = path.encode()
    if not name or name.startswith(b"/") or ".." in PurePosixPath(path).parts:
        raise ValueError(f"bad path for the payload: {path!r}")
    return ENTRY.pack(kind[0], 0, mode & 0o7777, len(name), 0, len(data)) + name + data


def payload_from_entries(entries: list[bytes]) -> bytes:
    return b"".join(entries) + ENTRY.pack(0, 0, 0, 0, 0, 0)


def payload_from_artifact(artifact: Path) -> bytes:
    """The bundle of the artifact tarball (``lib/node-agent/``), sorted, parents first."""
    found: dict[str, bytes] = {}
    with tarfile.open(artifact, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix("./")
            if not name.startswith(BUNDLE_PREFIX):
                continue
            path = name[len(BUNDLE_PREFIX) :].rstrip("/")
            if member.isdir():
                found[path] = payload_entry(b"d", path, member.mode, b"")
            elif member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                found[path] = payload_entry(b"f", path, member.mode, handle.read())
            elif member.issym():
                found[path] = payload_entry(b"l", path, 0o777, member.linkname.encode())
            else:
                raise ValueError(f"{artifact}: unsupported entry {member.name}")
    if "node-agent" not in found:
        raise ValueError(f"{artifact}: no {BUNDLE_PREFIX}node-agent bootloader")
    return payload_from_entries([found[path] for path in sorted(found)])


def zstd_compress(data: bytes, level: int = ZSTD_LEVEL) -> bytes:
    """One zstd frame that records the decompressed size (the launcher sizes its buffer by
    it) and zstd's checksum of the content. The same bytes for the same input whatever the
    number of threads (zstd's multi-threaded mode is deterministic)."""
    return subprocess.run(
        ["zstd", f"-{level}", "-T0", "-q", "-c", "--check", f"--stream-size={len(data)}"],
        input=data,
        stdout=subprocess.PIPE,
        check=True,
    ).stdout


def single_file(launcher: bytes, payload: bytes, *, level: int = ZSTD_LEVEL) -> bytes:
    """Launcher, payload (one zstd frame, at ``level``), trailer: the whole executable. The
    trailer's sha256 is of the payload as stored, and names the unpacked copy (the launcher
    checks the payload by zstd's own checksum while it decompresses it)."""
    stored = zstd_compress(payload, level)
    digest = hashlib.sha256(stored).digest()
    return launcher + stored + TRAILER.pack(MAGIC, FORMAT, ZSTD, len(launcher), len(stored), digest)


# -- the OCI image layout ---------------------------------------------------------------------
def _tar_info(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


def _gzip(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", fileobj=buffer, mode="wb", compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return buffer.getvalue()


def layer_tar(executable: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(
            _tar_info(IMAGE_FILE, tarfile.REGTYPE, 0o755, len(executable)), io.BytesIO(executable)
        )
        tar.addfile(_tar_info("ko-app", tarfile.DIRTYPE, 0o755))
        tar.addfile(_tar_info(KO_FILE, tarfile.LNKTYPE, 0o755, link=IMAGE_FILE))
    return buffer.getvalue()


def _descriptor(media_type: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": f"sha256:{_sha256(data)}", "size": len(data)}


def image_manifest(executable: bytes, version: str, arch: str) -> tuple[bytes, dict[str, bytes]]:
    """One platform's manifest and its blobs (the config and the gzip layer) by digest."""
    layer = layer_tar(executable)
    layer_gz = _gzip(layer)
    config = _json(
        {
            "architecture": arch,
            "os": "linux",
            "config": {
                "Entrypoint": [f"/{IMAGE_FILE}"],
                "Labels": {"org.opencontainers.image.version": version},
            },
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{_sha256(layer)}"]},
        }
    )
    manifest = _json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": _descriptor(CONFIG_TYPE, config),
            "layers": [_descriptor(LAYER_TYPE, layer_gz)],
        }
    )
    return manifest, {_sha256(b): b for b in (layer_gz, config, manifest)}


def image_layout(executables: Mapping[str, bytes], version: str) -> tuple[bytes, str]:
    """The OCI image layout tarball and its image index's digest (what a registry names the
    pushed image by). ``executables``: the single file of each architecture (``ARCHES``).

    ``index.json`` names one image index, as multi-platform layouts do, so that a copy by
    reference (``oci-archive:<file>:<version>``) takes both platforms; the index lists the
    platforms' manifests in ``ARCHES`` order."""
    blobs: dict[str, bytes] = {}
    entries = []
    for arch in sorted(executables, key=ARCHES.index):
        manifest, manifest_blobs = image_manifest(executables[arch], version, arch)
        blobs.update(manifest_blobs)
        entries.append(
            {
                **_descriptor(MANIFEST_TYPE, manifest),
                "platform": {"architecture": arch, "os": "linux"},
            }
        )
    index = _json({"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": entries})
    blobs[_sha256(index)] = index
    top = _json(
        {
            "schemaVersion": 2,
            "mediaType": INDEX_TYPE,
            "manifests": [
                {
                    **_descriptor(INDEX_TYPE, index),
                    "annotations": {"org.opencontainers.image.ref.name": version},
                }
            ],
        }
    )
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": top,
        **{f"blobs/sha256/{digest}": data for digest, data in blobs.items()},
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            tar.addfile(_tar_info(directory, tarfile.DIRTYPE, 0o755))
        for name in sorted(files):
            data = files[name]
            tar.addfile(_tar_info(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    return buffer.getvalue(), f"sha256:{_sha256(index)}"


# -- the build --------------------------------------------------------------------------------
def _artifact(out: Path, arch: str) -> Path:
    env = {
        **os.environ,
        "PYTHON": os.environ.get("PYTHON", sys.executable),
        "NODE_AGENT_ARCH": arch,
    }
    built = subprocess.run(
        ["sh", str(SRC / "packaging" / "build.sh"), str(out)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        check=False,
    )
    if built.returncode != 0:
        _die(f"packaging/build.sh failed for {arch}")
    return Path(built.stdout.strip().splitlines()[-1])


def _wait_synced(root: Path, timeout: float = 120.0) -> None:
    """Until the launcher's background sync has marked the unpacked copy as on disk."""
    deadline = time.monotonic() + timeout
    while not any(root.glob("*/.complete")):
        if time.monotonic() > deadline:
            _die(f"the unpacked copy under {root} was never marked complete")
        time.sleep(0.01)


def run_as(arch: str, argv: Sequence[str], work: Path, env: Mapping[str, str]) -> str:
    """Run ``argv`` (paths under ``work``) as a program of ``arch`` and return its output:
    directly on this machine's architecture, else inside that architecture's root file system
    under emulation (its glibc and libsystemd, as on a node), with ``work`` mounted at
    ``/build`` and the paths in ``argv`` and ``env`` rewritten to it."""
    if arch == native_arch():
        found = subprocess.run(
            list(argv), capture_output=True, text=True, env={**os.environ, **env}, check=False
        )
        return found.stdout + found.stderr
    inside = [a.replace(str(work), "/build") for a in argv]
    assignments = [f"{k}={v.replace(str(work), '/build')}" for k, v in env.items()]
    script = (
        'root=$1 work=$2; shift 2; mount --rbind /dev "$root/dev"; '
        'mount -t proc proc "$root/proc"; mount -t tmpfs tmpfs "$root/tmp"; '
        'mount --bind "$work" "$root/build"; '
        'exec chroot "$root" /usr/bin/env -i PATH=/usr/bin:/bin "$@"'
    )
    found = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-euc", script, "sh",
         str(rootfs(arch)), str(work), *assignments, *inside],
        capture_output=True,
        text=True,
        check=False,
    )  # fmt: skip
    return found.stdout + found.stderr


def _compiler_versions(arches: Sequence[str]) -> list[bytes]:
    """Each compiler's version and the other architecture's libzstd.a: what the launchers
    are made of besides launcher.c."""
    parts = []
    for arch in arches:
        cc, zstd = compiler(arch)
        version = subprocess.run(
            [cc[0], "--version"], capture_output=True, text=True, check=True
        ).stdout.splitlines()[0]
        parts.append(f"{arch} {version}".encode())
        if arch != native_arch():
            parts.append(hashlib.sha256(Path(zstd[0]).read_bytes()).hexdigest().encode())
    return parts


def build(out: Path, arches: Sequence[str] = ARCHES) -> Path:
    """The image of ``arches`` (all of ``ARCHES`` unless a test needs fewer) into ``out``."""
    if not arches or any(arch not in ARCHES for arch in arches):
        _die(f"platforms must be some of {' '.join(ARCHES)}, not {' '.join(arches)!r}")
    arches = sorted(set(arches), key=ARCHES.index)
    out.mkdir(parents=True, exist_ok=True)
    artifacts = {arch: _artifact(out, arch) for arch in arches}
    version = artifacts[arches[0]].name.removeprefix("node-agent-")
    version = version.removesuffix(f"-linux-{arches[0]}.tar.gz")
    singles = {arch: f"node-agent-{version}-linux-{arch}.bin" for arch in arches}
    layout_name = f"node-agent-{version}-image.oci.tar"
    cache = Path(
        os.environ.get("NODE_AGENT_BUILD_CACHE")
        or Path(os.environ.get("NODE_AGENT_TEST_CACHE") or Path.home() / ".cache/node-agent-test")
        / "artifact"
    )
    key_input = b"\n".join(
        [
            " ".join(arches).encode(),
            *(hashlib.sha256(artifacts[a].read_bytes()).hexdigest().encode() for a in arches),
            hashlib.sha256(LAUNCHER_C.read_bytes()).hexdigest().encode(),
            hashlib.sha256(Path(__file__).read_bytes()).hexdigest().encode(),
            *_compiler_versions(arches),
        ]
    )
    done = cache / "images" / f"{version}-{_sha256(key_input)[:16]}"
    names = [layout_name, *singles.values()]
    if not all((done / name).is_file() for name in names):
        (cache / "images").mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache / "images", prefix="work.") as work:
            tmp = Path(work)
            print(f"packaging/image.py: building {layout_name}", file=sys.stderr)
            (tmp / "done").mkdir()
            executables = {}
            for arch in arches:
                compile_launcher(tmp / f"launcher-{arch}", arch)
                executable = single_file(
                    (tmp / f"launcher-{arch}").read_bytes(), payload_from_artifact(artifacts[arch])
                )
                single = tmp / "done" / singles[arch]
                single.write_bytes(executable)
                single.chmod(0o755)
                unpack = tmp / f"unpack-{arch}"
                said = run_as(
                    arch, [str(single), "version"], tmp, {"NODE_AGENT_UNPACK_DIR": str(unpack)}
                )
                if said.strip() != f"node-agent {version}":
                    _die(f"the {arch} single file does not run: {said!r}")
                _wait_synced(unpack)  # its background sync writes there; then it goes
                executables[arch] = executable
            layout, _ = image_layout(executables, version)
            (tmp / "done" / layout_name).write_bytes(layout)
            shutil.rmtree(done, ignore_errors=True)
            (tmp / "done").rename(done)  # complete or absent
        olds = sorted((cache / "images").glob(f"*-{'?' * 16}"), key=lambda p: p.stat().st_mtime)
        for old in olds[:-3]:
            shutil.rmtree(old, ignore_errors=True)
    for name in names:
        shutil.copyfile(done / name, out / name)
    for name in singles.values():
        (out / name).chmod(0o755)
    return out / layout_name


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else SRC / "dist"
    arches = os.environ.get("NODE_AGENT_IMAGE_ARCHES", "").split() or ARCHES
    print(build(out.resolve(), arches))


if __name__ == "__main__":
    main()
