"""Unusable things where a state file should be: what the fault campaign and the apply state
machine plant while the agent is down, to prove it sets them aside (never follows, waits on or
reads them unbounded) and still converges."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PLANT_SHAPES = ("directory", "fifo", "symlink", "garbage")


def plant_unusable(
    path: Path,
    shape: str,
    *,
    symlink_to: str = "/dev/zero",
    garbage: bytes = b"\x00{not a document\n",
) -> None:
    """Replace whatever is at ``path`` with ``shape``: a directory (not empty), a FIFO, a
    symlink to ``symlink_to``, or the ``garbage`` bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()
    if shape == "directory":
        path.mkdir()
        (path / "x").write_text("x\n")
    elif shape == "fifo":
        os.mkfifo(path)
    elif shape == "symlink":
        path.symlink_to(symlink_to)
    elif shape == "garbage":
        path.write_bytes(garbage)
    else:
        raise ValueError(f"no such shape to plant: {shape}")
