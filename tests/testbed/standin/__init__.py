"""Stand-in node binaries (tiny Go programs) that test images carry instead of the real ones.

The throwaway node hides the host's Python, so a stand-in must be a static binary. Each is
built once with the machine's Go (``CGO_ENABLED=0``) and cached under ``$NODE_AGENT_TEST_CACHE``
keyed by the hash of its sources, like the control plane.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from tests.testbed.agent_harness import wait_for
from tests.testbed.systemd_ns import HarnessError

HERE = Path(__file__).parent


def _cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "node-agent-test"
    return Path(os.environ.get("NODE_AGENT_TEST_CACHE", default))


def _source_hash(source: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def build(name: str) -> Path:
    """The binary of ``standin/<name>/`` for linux/amd64 (built on first use, then reused from
    the cache)."""
    source = HERE / name
    if not (source / "go.mod").is_file():
        raise HarnessError(f"no stand-in named {name!r}")
    cache = _cache_root()
    out = cache / f"standin-{name}-{_source_hash(source)}" / name
    if out.is_file():
        return out
    go = shutil.which("go") or "/usr/local/go/bin/go"
    if not Path(go).exists():
        raise HarnessError(f"Go is required to build the stand-in {name}")
    tmp = out.with_name(f"{name}.tmp{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        CGO_ENABLED="0",
        GOOS="linux",
        GOARCH="amd64",
        GOTOOLCHAIN="local",
        GOFLAGS="",
        GOCACHE=str(cache / "go-build"),
        GOMODCACHE=str(cache / "go-mod"),
        GOTMPDIR=str(cache / "go-tmp"),
    )
    (cache / "go-tmp").mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(tmp), "."],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        raise HarnessError(f"building the stand-in {name} failed:\n{result.stderr[-4000:]}")
    tmp.replace(out)
    return out


def kubelet_binary() -> bytes:
    """The stand-in kubelet: ``GET /healthz`` → ``ok`` on 127.0.0.1:10248 (``--healthz-port``)."""
    return build("kubelet").read_bytes()


def kubelet_image_files(version: str = "v1.33.0") -> dict[str, tuple[bytes, int]]:
    """Files of a stand-in hyperkube image: ``/kubelet`` (0755) and a ``/version`` marker, so
    that images of different versions have different digests."""
    return {
        "/kubelet": (kubelet_binary(), 0o755),
        "/version": (version.encode() + b"\n", 0o644),
    }


async def kubelet_healthz(port: int, timeout: float = 20.0) -> tuple[int, bytes]:
    """The stand-in kubelet's ``/healthz`` on 127.0.0.1 (a throwaway node shares the host's
    network namespace): (status, body) of the first answer within ``timeout`` seconds."""
    answer: list[tuple[int, bytes]] = []

    async def answered() -> bool:
        try:
            url = f"http://127.0.0.1:{port}/healthz"
            with urllib.request.urlopen(url, timeout=2) as resp:
                answer.append((int(resp.status), bytes(resp.read())))
        except urllib.error.HTTPError as err:
            answer.append((int(err.code), bytes(err.read())))
        except OSError:
            return False
        return True

    await wait_for(answered, timeout, "kubelet's /healthz")
    return answer[-1]
