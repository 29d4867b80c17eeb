"""The single-file agent of the OCI image: sizes and start-up times.

Builds (or reuses from the cache) the image with the script ``make image`` runs, then times
``gardener-node-agent version`` from the single file: the first start after an install or
update (the payload is verified, decompressed and unpacked into a fresh unpack directory; the
copy's sync to disk runs in the background, and how long until it is on disk is printed too)
and warm starts (the unpacked copy is reused), against the unpacked bootloader run directly
(what the launcher adds). CPU time (user + system of the start and its children) is printed
next to wall time: the machine may be shared. Run from the repository root:

    .venv/bin/python -m bench.agent_image [--rounds 15] [--dirty MB] [--arch amd64|arm64]

``--dirty MB``: before each first start, MB of other data are written (not synced) next to the
unpack directory, as on a node whose containerd has just pulled images: what a start that
flushes the file system would wait for.

``--arch arm64`` (on an x86-64 machine): the same for the linux/arm64 single file, run through
qemu-aarch64 (binfmt_misc) with the arm64 root file system of ``packaging/rootfs.sh`` as its
library prefix; and, under the same kind of emulation, the Python part of each bundle's start:
PyInstaller's bootloader re-executes itself once with its library path set, and qemu-user runs
an exec of an x86-64 program natively, so both bundles' second stage is started directly under
``qemu-aarch64-static`` and ``qemu-x86_64-static`` with the environment the first stage would
have set. These figures are emulated and say nothing about a real arm64 machine's speed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from tests.testbed.agent_image import ARCHES, agent_image_layout, layer_members, read_layout
from tests.testbed.arm64_node import arm64_rootfs

CACHE = Path(os.environ.get("NODE_AGENT_TEST_CACHE") or Path.home() / ".cache/node-agent-test")


CPU: list[float] = []  # CPU seconds of each timed run, in order


def timed(argv: list[str], executable: Path, env: dict[str, str]) -> float:
    before = os.times()
    started = time.perf_counter()
    result = subprocess.run(
        argv, executable=str(executable), env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - started
    after = os.times()
    CPU.append(
        after.children_user + after.children_system - before.children_user - before.children_system
    )
    if result.returncode != 0 or not result.stdout.startswith("node-agent "):
        raise SystemExit(f"{executable} failed: {result.stdout!r} {result.stderr!r}")
    return seconds


def durable(root: Path, started: float) -> float:
    """Seconds from ``started`` until the unpacked copy has its ``.complete`` (synced)."""
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline:
        if any(root.glob("*/.complete")):
            return time.perf_counter() - started
        time.sleep(0.005)
    raise SystemExit(f"no .complete under {root} after 120 s")


def second_stage_env(bundle: Path) -> dict[str, str]:
    """What PyInstaller's bootloader sets before it re-executes itself: started with it, the
    bootloader runs Python at once (the stage a start spends its time in)."""
    return {
        "_PYI_ARCHIVE_FILE": str(bundle / "node-agent"),
        "_PYI_PARENT_PROCESS_LEVEL": "-1",
        "_PYI_LINUX_PROCESS_NAME": "node-agent",
        "LD_LIBRARY_PATH": str(bundle / "_internal"),
    }


def cpu(samples: list[float]) -> str:
    return f"CPU p50 {statistics.median(samples) * 1000:5.0f} ms"


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"p50 {statistics.median(ordered) * 1000:6.0f} ms   p90 {p90 * 1000:6.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--dirty", type=int, default=0, help="MB written unsynced before a first start"
    )
    parser.add_argument("--arch", choices=ARCHES, default="amd64", help="whose single file")
    args = parser.parse_args()
    emulated = args.arch != "amd64"

    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE / "tmp", prefix="bench-agent-image.") as work:
        tmp = Path(work)
        started = time.perf_counter()
        built = agent_image_layout(tmp / "dist")
        print(f"image build (make image; cache hit or not): {time.perf_counter() - started:.1f}s")
        index = read_layout(built.layout)
        with tarfile.open(fileobj=None, name=str(built.layout)) as tar:
            members = len(tar.getmembers())
        print(f"image {built.layout.name}: layout tar {built.layout.stat().st_size / 1e6:.1f} MB "
              f"({members} entries), index {index.digest[:19]}…")  # fmt: skip
        for arch in ARCHES:
            (layer,) = index.image(arch).layers
            tarball = next((tmp / "dist").glob(f"node-agent-*-linux-{arch}.tar.gz"))
            single = layer_members(index.image(arch))["gardener-node-agent"].size / 1e6
            onedir = tarball.stat().st_size / 1e6
            print(f"  linux/{arch}: compressed layer {layer.size / 1e6:.1f} MB, single file "
                  f"{single:.1f} MB (onedir tarball {onedir:.1f} MB)")  # fmt: skip

        exe = tmp / "opt" / "bin" / "gardener-node-agent"
        exe.parent.mkdir(parents=True)
        shutil.copyfile(built.single_file(args.arch), exe)
        exe.chmod(0o755)
        argv = ["gardener-node-agent", "version"]
        base_env = {"PATH": "/usr/bin:/bin"}
        if emulated:  # arm64's loader, glibc and libsystemd, as a node has them
            base_env["QEMU_LD_PREFIX"] = str(arm64_rootfs())

        first: list[float] = []
        synced: list[float] = []
        for i in range(args.rounds):
            root = tmp / f"first-{i}"
            if args.dirty:
                with open(tmp / "dirty", "wb") as other:  # written back later, by the kernel
                    for _ in range(args.dirty):
                        other.write(os.urandom(1 << 20))
            started = time.perf_counter()
            first.append(timed(argv, exe, {**base_env, "NODE_AGENT_UNPACK_DIR": str(root)}))
            synced.append(durable(root, started))
            shutil.rmtree(root)
            (tmp / "dirty").unlink(missing_ok=True)
        first_cpu = CPU[-args.rounds :]
        root = tmp / "warm"
        env = {**base_env, "NODE_AGENT_UNPACK_DIR": str(root)}
        timed(argv, exe, env)
        durable(root, time.perf_counter())
        warm = [timed(argv, exe, env) for _ in range(args.rounds)]
        warm_cpu = CPU[-args.rounds :]
        (bundle,) = [p for p in root.iterdir() if not p.name.startswith(".")]
        direct = [timed(argv, bundle / "node-agent", base_env) for _ in range(args.rounds)]
        direct_cpu = CPU[-args.rounds :]
        size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())

        stages: dict[str, tuple[list[float], list[float]]] = {}
        if emulated:  # each bundle's Python part under the same emulation
            amd64_root = tmp / "amd64"
            amd64_exe = tmp / "amd64.bin"
            shutil.copyfile(built.single_file("amd64"), amd64_exe)
            amd64_exe.chmod(0o755)
            native_env = {"PATH": base_env["PATH"]}
            timed(argv, amd64_exe, {**native_env, "NODE_AGENT_UNPACK_DIR": str(amd64_root)})
            durable(amd64_root, time.perf_counter())
            (amd64_bundle,) = [p for p in amd64_root.iterdir() if not p.name.startswith(".")]
            for arch, qemu, home, qemu_env in (
                ("amd64", "qemu-x86_64-static", amd64_bundle, native_env),
                ("arm64", "qemu-aarch64-static", bundle, base_env),
            ):
                stage_env = {**qemu_env, **second_stage_env(home)}
                stage = [qemu, "-0", "gardener-node-agent", str(home / "node-agent"), "version"]
                qemu_exe = Path(shutil.which(qemu) or qemu)
                samples = [timed(stage, qemu_exe, stage_env) for _ in range(args.rounds)]
                stages[arch] = (samples, CPU[-args.rounds :])

        where = f"linux/{args.arch}" + (" EMULATED (qemu-aarch64 on x86-64)" if emulated else "")
        print(f"`gardener-node-agent version` of {where}, {args.rounds} rounds (page cache warm; "
              f"load average {os.getloadavg()[0]:.2f}; {args.dirty} MB of other data unsynced "
              "before each first start):")  # fmt: skip
        print(f"  first start (verify + unpack {size / 1e6:.0f} MB)   {summary(first)}   "
              f"{cpu(first_cpu)}")  # fmt: skip
        print(f"  first start -> copy on disk (.complete)     {summary(synced)}")
        print(f"  warm start (unpacked copy reused)          {summary(warm)}   {cpu(warm_cpu)}")
        print(f"  unpacked bootloader run directly          {summary(direct)}   "
              f"{cpu(direct_cpu)}")  # fmt: skip
        overhead = statistics.median(warm) - statistics.median(direct)
        print(f"  launcher overhead on a warm start: {overhead * 1000:.1f} ms (p50 difference)")
        for arch, (samples, cpu_samples) in stages.items():
            print(f"  {arch} bundle's Python part, qemu-user (EMULATED) {summary(samples)}   "
                  f"{cpu(cpu_samples)}")  # fmt: skip


if __name__ == "__main__":
    main()
