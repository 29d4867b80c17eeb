"""Decode time of a 1 MiB osc.yaml: checksum, YAML, structure limits, model, validation.

Three documents just under the 1 MiB limit, each built around the realistic Gardener OSC of
``tests/unit/data``:
- ``many-files``: 1,000+ small base64 files and 200 units with drop-ins (a big pool config);
- ``big-content``: a few files of large base64 content (binaries and bundles inlined);
- ``dense``: the worst case for the parser, a flow list of small numbers in ``criConfig``
  (one YAML event per two bytes).

Prints the median and best wall time of ``decode_osc`` per document, and how fast a 60 KB
document nested 30,000 levels deep is refused (it used to crash the YAML composer).

Run from the repository root: ``.venv/bin/python -m bench.osc_decode [--runs 15]``
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from node_agent.base.errors import OSCError
from node_agent.osc.decode import MAX_OSC_BYTES, decode_osc

REALISTIC = Path(__file__).resolve().parents[1] / "tests/unit/data/osc-realistic.yaml"
LIMIT = MAX_OSC_BYTES - 4096


def base_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(REALISTIC.read_bytes())
    return doc


def dump(doc: dict[str, Any]) -> bytes:
    return yaml.safe_dump(doc, sort_keys=False).encode()


def many_files() -> bytes:
    doc = base_doc()
    files, units = doc["spec"]["files"], doc["spec"]["units"]
    for i in range(200):
        units.append(
            {
                "name": f"bench-{i}.service",
                "command": "restart",
                "enable": True,
                "content": f"[Unit]\nDescription=bench {i}\n[Service]\nExecStart=/bin/true\n",
                "dropIns": [{"name": "10-env.conf", "content": "[Service]\nEnvironment=A=1\n"}],
                "filePaths": [f"/etc/bench/{i}/0.conf"],
            }
        )
    i = 0
    while True:
        data = base64.b64encode(hashlib.sha256(str(i).encode()).digest() * 14).decode()
        files.append(
            {
                "path": f"/etc/bench/{i % 200}/{i}.conf",
                "permissions": 0o644,
                "content": {"inline": {"encoding": "b64", "data": data}},
            }
        )
        if i % 50 == 0 and len(dump(doc)) > LIMIT:
            del files[-50:]
            return dump(doc)
        i += 1


def big_content() -> bytes:
    doc = base_doc()
    files = doc["spec"]["files"]
    room = LIMIT - len(dump(doc))
    size = room * 3 // 4 // 4  # four files of base64 (4 bytes per 3)
    while True:
        for i in range(4):
            data = base64.encodebytes(bytes(range(256)) * (size // 256)).decode()
            files.append(
                {
                    "path": f"/opt/bench/blob-{i}",
                    "permissions": 0o755,
                    "content": {"inline": {"encoding": "b64", "data": data}},
                }
            )
        raw = dump(doc)
        if len(raw) <= LIMIT:
            return raw
        del files[-4:]
        size = size * LIMIT // len(raw) - 256


def dense() -> bytes:
    doc = base_doc()
    head = dump(doc)
    count = (LIMIT - len(head)) // 2
    text = head.decode().replace(
        "    containerd:\n", "    containerd:\n      bench: [" + ",".join(["0"] * count) + "]\n", 1
    )
    return text.encode()


def deep(depth: int) -> bytes:
    return b"a: " + b"[" * depth + b"]" * depth + b"\n"


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    for name, build in (("many-files", many_files), ("big-content", big_content), ("dense", dense)):
        raw = build()
        checksum = hashlib.sha256(raw).hexdigest()
        osc = decode_osc(raw, checksum)
        times = timed(functools.partial(decode_osc, raw, checksum), args.runs)
        print(
            f"{name:12} {len(raw):>8} bytes  {len(osc.spec.files):>5} files  "
            f"median {statistics.median(times) * 1000:7.1f} ms  best {min(times) * 1000:7.1f} ms"
        )
    raw = deep(30_000)
    checksum = hashlib.sha256(raw).hexdigest()

    def refuse() -> None:
        try:
            decode_osc(raw, checksum)
        except OSCError:
            return
        raise AssertionError("a 30,000-deep document was accepted")

    times = timed(refuse, args.runs)
    print(
        f"{'deep':12} {len(raw):>8} bytes  refused       "
        f"median {statistics.median(times) * 1000:7.1f} ms  best {min(times) * 1000:7.1f} ms"
    )


if __name__ == "__main__":
    main()
