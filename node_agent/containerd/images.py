"""Files taken from container images, pulled through the node's containerd.

An OSC file whose content is an ``imageRef`` is a file inside an image (kubelet from the
hyperkube image, the agent's own binary). ``CtrImages`` gets it with containerd's own CLI,
``ctr``, which ships with containerd: the pull reads ``/etc/containerd/certs.d`` (``--hosts-dir``)
so the registry mirrors configured there apply, and the image's root file system is mounted
read-only on a directory of its own, the file read, and the mount and its snapshot removed.
The namespace is ``CONTAINERD_NAMESPACE`` or ``default`` and the socket ``CONTAINERD_ADDRESS``
or containerd's default, as upstream gardener-node-agent does.

Where ``ctr`` runs: on a node, in the agent's own mount namespace (no ``argv_prefix``), and the
agent's root is ``/``. The test bed runs the agent on the host against a throwaway node whose
root it sees at ``/proc/<pid>/root``, and runs ``ctr`` inside that node (``argv_prefix`` is an
``nsenter`` into it), so that ``ctr`` reads the node's ``hosts.toml`` and CA files and its mounts
land in the node's mount namespace. Paths handed to ``ctr`` are then the node's own paths, and
the agent reads the mounted file through ``root`` (``/proc/<pid>/root`` shows that namespace's
mounts). Without a prefix, ``ctr`` shares the agent's view and gets the paths under ``root``.

Symlinks inside the image are resolved inside the mounted image, never on the host: an image's
``/kubelet -> /usr/bin/kubelet`` names the image's file, not the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import stat
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from node_agent.base import layout
from node_agent.base.errors import ImageError
from node_agent.base.log import get_logger

log = get_logger("node-agent.images")

NAMESPACE_ENV = "CONTAINERD_NAMESPACE"
DEFAULT_NAMESPACE = "default"
HOSTS_DIR = layout.CONTAINERD_CERTS_DIR
MOUNT_DIR = "/run/node-agent/image-mounts"
PULL_TIMEOUT = 300.0
CALL_TIMEOUT = 60.0
MAX_FILE_SIZE = 1 << 30  # read into memory before the atomic write; a kubelet is ~100 MiB
_MAX_SYMLINKS = 40
_REASON_LIMIT = 300


class ImageStore(Protocol):
    """Where imageRef files come from (``CtrImages`` on a node, a fake in unit tests)."""

    async def pull(self, image: str) -> str:
        """Pull ``image`` (unpacked) and return its manifest or index digest."""
        ...

    async def read_file(self, image: str, path_in_image: str) -> bytes:
        """The bytes of the regular file ``path_in_image`` of the pulled ``image``."""
        ...


@dataclass(frozen=True)
class ImagePull:
    """One imageRef file written: from which image (and digest), how many bytes, how long."""

    image: str
    digest: str
    path_in_image: str
    target: str
    size: int
    seconds: float


def normalize_reference(image: str) -> str:
    """The fully qualified reference ``ctr`` needs and lists (``ctr`` does not add Docker
    Hub's defaults): ``nginx`` -> ``docker.io/library/nginx:latest``."""
    name, digest = image.split("@", 1) if "@" in image else (image, "")
    first, _, rest = name.partition("/")
    if not rest or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name}" if rest else f"docker.io/library/{name}"
    elif first == "docker.io" and "/" not in rest:
        name = f"docker.io/library/{rest}"
    if not digest and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return f"{name}@{digest}" if digest else name


def parse_images_ls(output: str, reference: str) -> str | None:
    """The digest column of ``ctr images ls`` for ``reference`` (REF TYPE DIGEST SIZE ...)."""
    for line in output.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[0] == reference and fields[2].startswith("sha256:"):
            return fields[2]
    return None


def ctr_reason(stderr: str, stdout: str = "") -> str:
    """ctr's own one-line reason: its last ``ctr: ...`` line, else the last line it printed."""
    lines = [ln.strip() for ln in (stderr or stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ctr: ")]
    reason = (errors or lines or ["no output"])[-1].removeprefix("ctr: ")
    return reason if len(reason) <= _REASON_LIMIT else reason[: _REASON_LIMIT - 3] + "..."


def resolve_in_image(top: Path, path_in_image: str) -> Path:
    """``path_in_image`` under the mounted image ``top``, with symlinks resolved as inside the
    image (absolute targets start at ``top``, ``..`` stops at it). Raises ``FileNotFoundError``
    or ``OSError(ELOOP)`` like the kernel would."""
    todo = [p for p in path_in_image.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    while todo:
        name = todo.pop(0)
        if name == "..":
            if done:
                done.pop()
            continue
        here = top.joinpath(*done, name)
        if stat.S_ISLNK(os.lstat(here).st_mode):
            hops += 1
            if hops > _MAX_SYMLINKS:
                raise OSError(40, "too many levels of symbolic links", path_in_image)
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            todo = [p for p in target.split("/") if p not in ("", ".")] + todo
            continue
        done.append(name)
    return top.joinpath(*done)


class CtrImages:
    """``ImageStore`` over ``ctr`` (see the module docstring for ``root`` and ``argv_prefix``)."""

    def __init__(
        self,
        *,
        root: Path | str = "/",
        namespace: str | None = None,
        argv_prefix: Sequence[str] = (),
        ctr: str = "ctr",
        hosts_dir: str = HOSTS_DIR,
        mount_dir: str = MOUNT_DIR,
        pull_timeout: float = PULL_TIMEOUT,
        call_timeout: float = CALL_TIMEOUT,
        max_file_size: int = MAX_FILE_SIZE,
    ) -> None:
        self.root = Path(root)
        self.namespace = namespace or os.environ.get(NAMESPACE_ENV) or DEFAULT_NAMESPACE
        self.argv_prefix = tuple(argv_prefix)
        self.ctr = ctr
        self.hosts_dir = hosts_dir
        self.mount_dir = mount_dir
        self.pull_timeout = pull_timeout
        self.call_timeout = call_timeout
        self.max_file_size = max_file_size

    def __repr__(self) -> str:
        return f"CtrImages(namespace={self.namespace!r}, root={str(self.root)!r})"

    # --- paths ------------------------------------------------------------------------------

    def host_path(self, path: str) -> Path:
        """Where the agent finds the node's ``path``."""
        return self.root / path.lstrip("/")

    def ctr_path(self, path: str) -> str:
        """The node's ``path`` as ``ctr`` sees it: its own if it runs inside the node."""
        return path if self.argv_prefix else str(self.host_path(path))

    def argv(self, *args: str) -> list[str]:
        return [*self.argv_prefix, self.ctr, "-n", self.namespace, *args]

    # --- ImageStore -------------------------------------------------------------------------

    async def pull(self, image: str) -> str:
        ref = normalize_reference(image)
        started = time.monotonic()
        await self._ctr(
            image,
            "pull",
            ["images", "pull", "--hosts-dir", self.ctr_path(self.hosts_dir), ref],
            limit=self.pull_timeout,
        )
        listing = await self._ctr(image, "list", ["images", "ls"], limit=self.call_timeout)
        digest = parse_images_ls(listing, ref)
        if digest is None:
            raise ImageError(image, f"pulled, but containerd does not list {ref}")
        log.info(
            "image pulled",
            image=image,
            digest=digest,
            namespace=self.namespace,
            seconds=round(time.monotonic() - started, 3),
        )
        return digest

    async def read_file(self, image: str, path_in_image: str) -> bytes:
        ref = normalize_reference(image)
        base = self.host_path(self.mount_dir)
        try:
            await asyncio.to_thread(base.mkdir, mode=0o700, parents=True, exist_ok=True)
            top = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="mount-", dir=base))
        except OSError as exc:
            raise ImageError(image, f"no mount directory under {self.mount_dir}: {exc}") from exc
        target = self.ctr_path(f"{self.mount_dir}/{top.name}")
        try:
            await self._ctr(
                image, "mount", ["images", "mount", ref, target], limit=self.call_timeout
            )
            try:
                return await asyncio.to_thread(self._read, image, top, path_in_image)
            finally:
                await self._unmount(image, target)
        finally:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(top.rmdir)

    async def _unmount(self, image: str, target: str) -> None:
        """Unmount and drop the view snapshot; a failure here does not fail the file (its
        bytes are read) but is logged: the mount stays until it is removed by hand."""
        try:
            await self._ctr(
                image, "unmount", ["images", "unmount", "--rm", target], limit=self.call_timeout
            )
        except ImageError as exc:
            log.warning("image mount left behind", image=image, mount=target, error=str(exc))

    def _read(self, image: str, top: Path, path_in_image: str) -> bytes:
        try:
            path = resolve_in_image(top, path_in_image)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ImageError(image, f"{path_in_image} is not in the image") from None
        except OSError as exc:
            raise ImageError(image, f"{path_in_image}: {exc.strerror or exc}") from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ImageError(image, f"{path_in_image} is not a regular file in the image")
            if info.st_size > self.max_file_size:
                raise ImageError(
                    image,
                    f"{path_in_image} is {info.st_size} bytes, over the limit of "
                    f"{self.max_file_size}",
                )
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read()
        finally:
            os.close(fd)

    async def _ctr(self, image: str, what: str, args: list[str], *, limit: float) -> str:
        """Run ``ctr`` off the event loop; its failure is an ``ImageError`` naming ``image``."""
        argv = self.argv(*args)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # a timeout kills ctr and whatever the prefix started
            )
        except OSError as exc:
            raise ImageError(image, f"{what}: cannot run {argv[0]}: {exc.strerror}") from exc
        try:
            async with asyncio.timeout(limit):
                out, err = await proc.communicate()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise ImageError(image, f"{what}: ctr did not finish within {limit:.0f}s") from None
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        stdout = out.decode(errors="replace")
        if proc.returncode != 0:
            reason = ctr_reason(err.decode(errors="replace"), stdout)
            raise ImageError(image, f"{what} failed: {reason}")
        return stdout
