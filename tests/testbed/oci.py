"""OCI images built by the test code itself and pushed over the registry's HTTP API.

No container daemon and no image tool: a layer is a gzipped tar written with ``tarfile``, the
config and manifest are JSON, and the push is the distribution API's monolithic blob upload.
Everything is deterministic (fixed mtimes, uid/gid 0, sorted entries, canonical JSON), so the
same files always give the same manifest digest. A multi-platform image is an image index of
such images (``build_index``), pushed as the registry stores it: each manifest by its digest,
then the index under the tag.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import ssl
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from tests.testbed.systemd_ns import HarnessError

INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"

Files = Mapping[str, tuple[bytes, int]]
"""``{path_in_image: (content, mode)}``; parent directories are added with mode 0755."""


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Blob:
    media_type: str
    data: bytes

    @property
    def digest(self) -> str:
        return _digest(self.data)

    @property
    def size(self) -> int:
        return len(self.data)

    def descriptor(self) -> dict[str, object]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class Image:
    layers: tuple[Blob, ...]
    config: Blob
    manifest: Blob

    @property
    def digest(self) -> str:
        """The manifest digest: what ``image@sha256:…`` and containerd name the image by."""
        return self.manifest.digest


@dataclass(frozen=True)
class Index:
    """A multi-platform image: an image index of one image per platform."""

    images: tuple[Image, ...]
    index: Blob

    @property
    def digest(self) -> str:
        """The index digest: what the registry and containerd name the image by."""
        return self.index.digest

    def platforms(self) -> list[tuple[str, str]]:
        """``(os, architecture)`` of each image, in the index's order."""
        manifests = json.loads(self.index.data)["manifests"]
        return [(m["platform"]["os"], m["platform"]["architecture"]) for m in manifests]

    def image(self, architecture: str, os: str = "linux") -> Image:
        """The image of one platform."""
        for platform, image in zip(self.platforms(), self.images, strict=True):
            if platform == (os, architecture):
                return image
        raise KeyError(f"no {os}/{architecture} image in the index {self.digest}")


def image_platform(image: Image) -> tuple[str, str]:
    """``(os, architecture)`` as the image's config says."""
    config = json.loads(image.config.data)
    return str(config["os"]), str(config["architecture"])


def build_index(images: Sequence[Image]) -> Index:
    """An image index of ``images`` (one per platform, each platform as its config says)."""
    entries = []
    for image in images:
        os, architecture = image_platform(image)
        entries.append(
            {**image.manifest.descriptor(), "platform": {"architecture": architecture, "os": os}}
        )
    data = _canonical_json({"schemaVersion": 2, "mediaType": INDEX_TYPE, "manifests": entries})
    return Index(tuple(images), Blob(INDEX_TYPE, data))


def _tar_info(name: str, *, mode: int, size: int = 0, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = mode
    info.size = size
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def layer_tar(files: Files) -> bytes:
    """The uncompressed layer: parent directories first, then every entry sorted by path."""
    entries: dict[str, tuple[bytes, int] | None] = {}
    for raw_path, (content, mode) in files.items():
        path = PurePosixPath("/", raw_path)
        if path == PurePosixPath("/") or ".." in path.parts:
            raise ValueError(f"bad path in image: {raw_path!r}")
        for parent in reversed(path.parents[:-1]):
            entries.setdefault(str(parent).lstrip("/"), None)
        entries[str(path).lstrip("/")] = (content, mode)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            entry = entries[name]
            if entry is None:
                tar.addfile(_tar_info(name, mode=0o755, directory=True))
            else:
                content, mode = entry
                tar.addfile(_tar_info(name, mode=mode, size=len(content)), io.BytesIO(content))
    return buffer.getvalue()


def _gzip(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", fileobj=buffer, mode="wb", compresslevel=1, mtime=0) as gz:
        gz.write(data)
    return buffer.getvalue()


def build_image(
    layers: Files | Sequence[Files],
    *,
    entrypoint: Sequence[str] = (),
    labels: Mapping[str, str] | None = None,
    architecture: str = "amd64",
    os: str = "linux",
) -> Image:
    """An OCI image (manifest v1, gzip layers) from one mapping of files or a list of them."""
    layer_files: list[Files] = [layers] if isinstance(layers, Mapping) else list(layers)
    tars = [layer_tar(files) for files in layer_files]
    blobs = tuple(Blob(LAYER_TYPE, _gzip(tar)) for tar in tars)
    container_config: dict[str, object] = {}
    if entrypoint:
        container_config["Entrypoint"] = list(entrypoint)
    if labels:
        container_config["Labels"] = dict(labels)
    config = Blob(
        CONFIG_TYPE,
        _canonical_json(
            {
                "architecture": architecture,
                "os": os,
                "config": container_config,
                "rootfs": {"type": "layers", "diff_ids": [_digest(tar) for tar in tars]},
            }
        ),
    )
    manifest = Blob(
        MANIFEST_TYPE,
        _canonical_json(
            {
                "schemaVersion": 2,
                "mediaType": MANIFEST_TYPE,
                "config": config.descriptor(),
                "layers": [blob.descriptor() for blob in blobs],
            }
        ),
    )
    return Image(blobs, config, manifest)


def _request(
    method: str,
    url: str,
    context: ssl.SSLContext,
    *,
    data: bytes | None = None,
    content_type: str = "application/octet-stream",
) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": content_type} if data is not None else {}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as resp:
            return int(resp.status), dict(resp.headers.items()), bytes(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), dict(err.headers.items()), bytes(err.read())


def _push_blob(base: str, repository: str, blob: Blob, context: ssl.SSLContext) -> None:
    status, _, _ = _request("HEAD", f"{base}/v2/{repository}/blobs/{blob.digest}", context)
    if status == 200:
        return
    status, headers, body = _request(
        "POST", f"{base}/v2/{repository}/blobs/uploads/", context, data=b""
    )
    location = headers.get("Location")
    if status != 202 or not location:
        raise HarnessError(f"upload of {blob.digest} to {repository} refused: {status} {body!r}")
    location = urllib.parse.urljoin(base + "/", location)
    separator = "&" if "?" in location else "?"
    target = f"{location}{separator}digest={urllib.parse.quote(blob.digest)}"
    status, _, body = _request("PUT", target, context, data=blob.data)
    if status != 201:
        raise HarnessError(f"upload of {blob.digest} to {repository} failed: {status} {body!r}")


def _put_manifest(
    base: str, repository: str, reference: str, manifest: Blob, context: ssl.SSLContext
) -> None:
    status, headers, body = _request(
        "PUT",
        f"{base}/v2/{repository}/manifests/{reference}",
        context,
        data=manifest.data,
        content_type=manifest.media_type,
    )
    if status != 201:
        raise HarnessError(f"manifest {repository}:{reference} refused: {status} {body!r}")
    digest = headers.get("Docker-Content-Digest", "")
    if digest != manifest.digest:
        raise HarnessError(
            f"registry named {repository}:{reference} {digest!r}, expected {manifest.digest!r}"
        )


def push(
    registry_url: str,
    repository: str,
    tag: str,
    image: Image | Index,
    context: ssl.SSLContext,
) -> str:
    """Push ``image`` as ``repository:tag``; return the digest the registry reports (the
    manifest's, or for an index the index's, its images' manifests pushed by digest first)."""
    base = registry_url.rstrip("/")
    images = image.images if isinstance(image, Index) else (image,)
    for each in images:
        for blob in (*each.layers, each.config):
            _push_blob(base, repository, blob, context)
    if isinstance(image, Index):
        for each in images:
            _put_manifest(base, repository, each.digest, each.manifest, context)
        _put_manifest(base, repository, tag, image.index, context)
    else:
        _put_manifest(base, repository, tag, image.manifest, context)
    return image.digest
