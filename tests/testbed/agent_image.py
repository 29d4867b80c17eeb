"""The agent's OCI image (``make image`` / ``packaging/image.py``) in tests: build or reuse it,
read its OCI image layout tarball (an image index of linux/amd64 and linux/arm64), push it to a
test registry.

``packaging/image.py`` is also imported as a module (``image_tool``) so tests can build
single files from their own small payloads with the real launcher and the real format.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tests.testbed import oci

REPO = Path(__file__).resolve().parents[2]
IMAGE_SCRIPT = REPO / "packaging" / "image.py"


#: the image's platforms (architectures of linux), in its index's order
ARCHES = ("amd64", "arm64")
#: ELF ``e_machine`` of each
ELF_MACHINES = {"amd64": 62, "arm64": 183}  # EM_X86_64, EM_AARCH64


@dataclass(frozen=True)
class AgentImage:
    layout: Path
    """``node-agent-<version>-image.oci.tar``"""
    version: str

    def single_file(self, arch: str) -> Path:
        """``node-agent-<version>-linux-<arch>.bin``, the single file the image carries for
        ``arch``."""
        return self.layout.with_name(f"node-agent-{self.version}-linux-{arch}.bin")

    @property
    def executable(self) -> Path:
        """The linux/amd64 single file (the test bed's own architecture)."""
        return self.single_file("amd64")


def elf_machine(data: bytes) -> int:
    """``e_machine`` of a little-endian ELF file (what ``file`` calls x86-64 or ARM aarch64)."""
    if data[:4] != b"\x7fELF" or data[5] != 1:
        raise ValueError("not a little-endian ELF file")
    return int.from_bytes(data[18:20], "little")


def agent_image_layout(
    out: Path, *, version: str | None = None, arches: Sequence[str] = ARCHES
) -> AgentImage:
    """Build the image into ``out`` with the script ``make image`` runs (cached by its key);
    ``version``: the same sources built as another version (a second image to update to);
    ``arches``: fewer platforms than ``make image``'s, for a test that needs only those (each
    arm64 build of new sources takes minutes under emulation)."""
    out.mkdir(parents=True, exist_ok=True)
    built = subprocess.run(
        [sys.executable, str(IMAGE_SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        env={
            **os.environ,
            "PYTHON": sys.executable,
            "NODE_AGENT_VERSION": version or "",
            "NODE_AGENT_IMAGE_ARCHES": " ".join(arches),
        },
    )
    if built.returncode != 0:
        raise RuntimeError(f"image build failed:\n{built.stderr[-3000:]}")
    layout = Path(built.stdout.strip().splitlines()[-1])
    version = layout.name.removeprefix("node-agent-").removesuffix("-image.oci.tar")
    return AgentImage(layout, version)


def read_layout(layout: Path) -> oci.Index:
    """The image index of an OCI image layout tarball (``index.json`` names one), with its
    images, as the test registry pushes it."""
    with tarfile.open(layout) as tar:

        def read(name: str) -> bytes:
            handle = tar.extractfile(name)
            if handle is None:
                raise ValueError(f"{layout}: {name} is not a file")
            return handle.read()

        def blob(media_type: str, descriptor: dict[str, object]) -> oci.Blob:
            algorithm, _, digest = str(descriptor["digest"]).partition(":")
            found = oci.Blob(media_type, read(f"blobs/{algorithm}/{digest}"))
            if found.digest != descriptor["digest"] or found.size != descriptor["size"]:
                raise ValueError(f"{layout}: blob {descriptor['digest']} does not match")
            return found

        def image(descriptor: dict[str, object]) -> oci.Image:
            manifest = blob(oci.MANIFEST_TYPE, descriptor)
            body = json.loads(manifest.data)
            config = blob(oci.CONFIG_TYPE, body["config"])
            layers = tuple(blob(layer["mediaType"], layer) for layer in body["layers"])
            return oci.Image(layers, config, manifest)

        if json.loads(read("oci-layout")) != {"imageLayoutVersion": "1.0.0"}:
            raise ValueError(f"{layout}: not an OCI image layout")
        (entry,) = json.loads(read("index.json"))["manifests"]
        if entry["mediaType"] != oci.INDEX_TYPE:
            raise ValueError(f"{layout}: index.json names a {entry['mediaType']}, not an index")
        index = blob(oci.INDEX_TYPE, entry)
        images = tuple(image(each) for each in json.loads(index.data)["manifests"])
    found = oci.Index(images, index)
    if found != oci.build_index(images):
        raise ValueError(f"{layout}: its index is not the canonical one of its images")
    return found


def layer_members(image: oci.Image) -> dict[str, tarfile.TarInfo]:
    """The entries of the image's (single) layer by path."""
    (layer,) = image.layers
    with tarfile.open(fileobj=io.BytesIO(layer.data), mode="r:gz") as tar:
        return {member.name: member for member in tar.getmembers()}


@functools.cache
def image_tool() -> ModuleType:
    """``packaging/image.py`` as a module."""
    spec = importlib.util.spec_from_file_location("node_agent_image_tool", IMAGE_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
