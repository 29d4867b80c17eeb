"""The pod sandbox image of the bed: ``pause/pause.c`` built static and packed as an OCI image.

Gardener's OSC names ``registry.k8s.io/pause`` as containerd's sandbox image; a machine of the
bed pulls it through a mirror to the bed's registry, where this image stands under the same
repository and tag. The program is compiled with the host's C compiler (static, so the image
needs nothing else), the binary kept in the workdir it is built in.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.testbed import oci
from tests.testbed.systemd_ns import HarnessError

SOURCE = Path(__file__).parent / "pause" / "pause.c"
#: the image's entry point, as in Kubernetes' own pause image
ENTRYPOINT = "/pause"


def build_binary(workdir: Path) -> Path:
    """The static pause binary, compiled into ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    binary = workdir / "pause"
    result = subprocess.run(
        ["gcc", "-static", "-Os", "-s", "-Wall", "-Werror", "-o", str(binary), str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise HarnessError(f"compiling {SOURCE.name} failed:\n{result.stderr[-4000:]}")
    return binary


def pause_image(workdir: Path) -> oci.Image:
    """The sandbox image for linux/amd64."""
    binary = build_binary(workdir).read_bytes()
    return oci.build_image({ENTRYPOINT: (binary, 0o755)}, entrypoint=[ENTRYPOINT])
