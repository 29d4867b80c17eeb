"""The single-file agent of the OCI image: sizes and start-up times.

Builds (or reuses from the cache) the image with the script ``make image`` runs, then times
``gardener-node-agent version`` from the single file: the first start after an install or
update (the payload is verified, decompressed and unpacked into a fresh unpack directory; the
copy's sync to disk runs in the background, and how long until it is on disk is printed too)
and warm starts (the unpacked copy is reused), against the unpacked bootloader run directly
(what the launcher adds). CPU time (user + system of the start and its children) is printed
next to wall time: the machine may be shared. Run from the repository root:

    .venv/bin/python -m bench.agent_image [--rounds 15] [--dirty MB]

``--dirty MB``: before each first start, MB of other data are written (not synced) next to the
unpack directory, as on a node whose containerd has just pulled images: what a start that
flushes the file system would wait for.
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

from tests.testbed.agent_image import agent_image_layout, read_layout

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
    args = parser.parse_args()

    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE / "tmp", prefix="bench-agent-image.") as work:
        tmp = Path(work)
        started = time.perf_counter()
        built = agent_image_layout(tmp / "dist")
        print(f"image build (make image; cache hit or not): {time.perf_counter() - started:.1f}s")
        image = read_layout(built.layout)
        (layer,) = image.layers
        with tarfile.open(fileobj=None, name=str(built.layout)) as tar:
            members = len(tar.getmembers())
        tarball = next((tmp / "dist").glob("node-agent-*-linux-amd64.tar.gz"))
        print(f"image {built.layout.name}: layout tar {built.layout.stat().st_size / 1e6:.1f} MB "
              f"({members} entries), compressed layer {layer.size / 1e6:.1f} MB, "
              f"manifest {image.digest[:19]}…")  # fmt: skip
        print(f"single file {built.executable.stat().st_size / 1e6:.1f} MB "
              f"(onedir tarball {tarball.stat().st_size / 1e6:.1f} MB)")  # fmt: skip

        exe = tmp / "opt" / "bin" / "gardener-node-agent"
        exe.parent.mkdir(parents=True)
        shutil.copyfile(built.executable, exe)
        exe.chmod(0o755)
        argv = ["gardener-node-agent", "version"]
        base_env = {"PATH": "/usr/bin:/bin"}

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

        print(f"`gardener-node-agent version`, {args.rounds} rounds (page cache warm; "
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


if __name__ == "__main__":
    main()
