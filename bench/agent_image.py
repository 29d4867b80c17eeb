"""The single-file agent of the OCI image: sizes and start-up times.

Builds (or reuses from the cache) the image with the script ``make image`` runs, then times
``gardener-node-agent version`` from the single file: the first start after an install or
update (the payload is verified and unpacked into a fresh unpack directory) and warm starts
(the unpacked copy is reused), against the unpacked bootloader run directly (what the launcher
adds). Run from the repository root:

    .venv/bin/python -m bench.agent_image [--rounds 15]
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


def timed(argv: list[str], executable: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(
        argv, executable=str(executable), env=env, capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0 or not result.stdout.startswith("node-agent "):
        raise SystemExit(f"{executable} failed: {result.stdout!r} {result.stderr!r}")
    return seconds


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"p50 {statistics.median(ordered) * 1000:6.0f} ms   p90 {p90 * 1000:6.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
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
        for i in range(args.rounds):
            root = tmp / f"first-{i}"
            first.append(timed(argv, exe, {**base_env, "NODE_AGENT_UNPACK_DIR": str(root)}))
            shutil.rmtree(root)
        root = tmp / "warm"
        env = {**base_env, "NODE_AGENT_UNPACK_DIR": str(root)}
        timed(argv, exe, env)
        warm = [timed(argv, exe, env) for _ in range(args.rounds)]
        (bundle,) = [p for p in root.iterdir() if not p.name.startswith(".")]
        direct = [timed(argv, bundle / "node-agent", base_env) for _ in range(args.rounds)]
        size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())

        print(f"`gardener-node-agent version`, {args.rounds} rounds (page cache warm):")
        print(f"  first start (verify + unpack {size / 1e6:.0f} MB + syncfs)  {summary(first)}")
        print(f"  warm start (unpacked copy reused)               {summary(warm)}")
        print(f"  unpacked bootloader run directly               {summary(direct)}")
        overhead = statistics.median(warm) - statistics.median(direct)
        print(f"  launcher overhead on a warm start: {overhead * 1000:.1f} ms (p50 difference)")


if __name__ == "__main__":
    main()
