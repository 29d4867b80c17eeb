"""Turn the bytes of a Secret's ``osc.yaml`` into a validated OperatingSystemConfig.

Upstream trusts both the checksum annotation and the content, and finds bad input only halfway
through applying it, leaving a half-written node. Here everything is checked before anything is
planned: the checksum, the size, the type, and every path, unit name, drop-in name, encoding and
mode. Each failure is a typed error (see ``node_agent.errors``) naming the offending item.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from node_agent.errors import OSCChecksumError, OSCDecodeError, OSCValidationError
from node_agent.osc.models import API_VERSION, KIND, File, InlineContent, OperatingSystemConfig

MAX_OSC_BYTES = 1024 * 1024
MAX_PERMISSIONS = 0o7777
UNIT_SUFFIXES = (
    "service",
    "socket",
    "timer",
    "mount",
    "automount",
    "path",
    "target",
    "slice",
    "scope",
    "swap",
    "device",
)
# systemd accepts letters, digits and ":-_.\" in a unit name, plus one "@" for templates.
_UNIT_CHARS = r"[A-Za-z0-9:_.\\-]"
_UNIT_NAME = re.compile(rf"{_UNIT_CHARS}+(@{_UNIT_CHARS}*)?\.({'|'.join(UNIT_SUFFIXES)})")
_UNIT_NAME_MAX = 255
_ENCODINGS = ("", "b64")

_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def sha256_hex(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def verify_checksum(raw: bytes, expected: str | None) -> None:
    """Check ``raw`` against the ``checksum/data-script`` annotation value."""
    actual = sha256_hex(raw)
    if not expected or not expected.strip():
        raise OSCChecksumError(
            "the OSC Secret has no checksum/data-script annotation; refusing unverified osc.yaml",
            expected=expected,
            actual=actual,
        )
    if not hmac.compare_digest(expected.strip().lower(), actual):
        raise OSCChecksumError(
            f"osc.yaml has sha256 {actual} but annotation checksum/data-script says {expected}",
            expected=expected,
            actual=actual,
        )


def decode_osc(
    raw: bytes, checksum: str | None, host_name: str | None = None
) -> OperatingSystemConfig:
    """Verify, parse and validate the ``osc.yaml`` bytes of an OSC Secret.

    ``host_name`` selects host-specific files for the duplicate-path check; without it, files
    that could land on the same host at the same path are rejected.
    """
    _check_size(raw)
    verify_checksum(raw, checksum)
    osc = parse_osc(raw)
    validate_osc(osc, host_name)
    return osc


def parse_osc(raw: bytes) -> OperatingSystemConfig:
    """Parse YAML or JSON bytes into the model, checking size, apiVersion and kind only."""
    _check_size(raw)
    try:
        obj = yaml.load(raw, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise OSCDecodeError(f"osc.yaml is not valid YAML or JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise OSCDecodeError(f"osc.yaml must hold a mapping, not {type(obj).__name__}")
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    if api_version != API_VERSION or kind != KIND:
        raise OSCDecodeError(
            f"osc.yaml has apiVersion {api_version!r} and kind {kind!r}; "
            f"expected {API_VERSION!r} and {KIND!r}"
        )
    try:
        return OperatingSystemConfig.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        where, item = _locate(obj, err["loc"])
        raise OSCValidationError(f"{where}: {err['msg']}", field=where, item=item) from exc


def validate_osc(osc: OperatingSystemConfig, host_name: str | None = None) -> None:
    """Reject values that cannot be applied safely; raise on the first one found."""
    for field, files in (
        ("spec.files", osc.spec.files),
        ("status.extensionFiles", osc.status.extension_files),
    ):
        for i, file in enumerate(files):
            _validate_file(f"{field}[{i}]", file)
    _check_duplicate_paths([*osc.spec.files, *osc.status.extension_files], host_name)
    for field, units in (
        ("spec.units", osc.spec.units),
        ("status.extensionUnits", osc.status.extension_units),
    ):
        for i, unit in enumerate(units):
            where = f"{field}[{i}]"
            validate_unit_name(unit.name, field=f"{where}.name")
            for j, drop_in in enumerate(unit.drop_ins):
                validate_drop_in_name(unit.name, drop_in.name, field=f"{where}.dropIns[{j}].name")


def decode_inline(inline: InlineContent, *, path: str, field: str | None = None) -> bytes:
    """Return the bytes an inline file content stands for (``""`` = plain, ``b64`` = base64)."""
    if inline.encoding not in _ENCODINGS:
        raise OSCValidationError(
            f"file {path}: unknown content encoding {inline.encoding!r} (allowed: '' or 'b64')",
            field=field,
            item=path,
        )
    if inline.encoding == "":
        return inline.data.encode()
    # Go's base64.StdEncoding skips CR and LF; anything else outside the alphabet is an error.
    compact = inline.data.replace("\r", "").replace("\n", "")
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise OSCValidationError(
            f"file {path}: content is not valid base64: {exc}", field=field, item=path
        ) from exc


def validate_path(path: str, *, field: str | None = None) -> None:
    """A file path must be absolute, normalized, free of ``..`` and NUL bytes."""

    def fail(why: str) -> OSCValidationError:
        return OSCValidationError(f"file path {path!r} {why}", field=field, item=path)

    if "\x00" in path:
        raise fail("contains a NUL byte")
    if not path.startswith("/"):
        raise fail("is not absolute")
    if ".." in path.split("/"):
        raise fail("contains a '..' segment")
    if path == "/" or path.endswith("/"):
        raise fail("names a directory, not a file")
    if posixpath.normpath(path) != path or path.startswith("//"):
        raise fail(f"is not normalized (expected {posixpath.normpath(path)!r})")


def validate_unit_name(name: str, *, field: str | None = None) -> None:
    def fail(why: str) -> OSCValidationError:
        return OSCValidationError(f"unit name {name!r} {why}", field=field, item=name)

    if "/" in name:
        raise fail("contains '/'")
    if len(name) > _UNIT_NAME_MAX:
        raise fail(f"is longer than {_UNIT_NAME_MAX} characters")
    if not _UNIT_NAME.fullmatch(name):
        raise fail(
            "is not a valid systemd unit name (letters, digits, ':-_.\\', one '@', "
            f"and a suffix out of .{', .'.join(UNIT_SUFFIXES)})"
        )


def validate_drop_in_name(unit: str, name: str, *, field: str | None = None) -> None:
    def fail(why: str) -> OSCValidationError:
        return OSCValidationError(
            f"drop-in {name!r} of unit {unit} {why}", field=field, item=f"{unit}/{name}"
        )

    if "/" in name or "\x00" in name:
        raise fail("contains '/' or a NUL byte")
    if not name.endswith(".conf") or name == ".conf":
        raise fail("must be a file name ending in .conf")


def _check_size(raw: bytes) -> None:
    if len(raw) > MAX_OSC_BYTES:
        raise OSCDecodeError(f"osc.yaml is {len(raw)} bytes, over the limit of {MAX_OSC_BYTES}")


def _validate_file(where: str, file: File) -> None:
    validate_path(file.path, field=f"{where}.path")
    if file.permissions is not None and not 0 <= file.permissions <= MAX_PERMISSIONS:
        raise OSCValidationError(
            f"file {file.path}: permissions {file.permissions} are outside 0..0o7777",
            field=f"{where}.permissions",
            item=file.path,
        )
    content = file.content
    sources = [s for s in (content.inline, content.secret_ref, content.image_ref) if s is not None]
    if len(sources) != 1:
        raise OSCValidationError(
            f"file {file.path}: content must set exactly one of inline, secretRef, imageRef "
            f"(found {len(sources)})",
            field=f"{where}.content",
            item=file.path,
        )
    if content.inline is not None:
        decode_inline(content.inline, path=file.path, field=f"{where}.content.inline")
    if content.secret_ref is not None and not (
        content.secret_ref.name and content.secret_ref.data_key
    ):
        raise OSCValidationError(
            f"file {file.path}: secretRef needs both name and dataKey",
            field=f"{where}.content.secretRef",
            item=file.path,
        )
    if content.image_ref is not None and not (
        content.image_ref.image and content.image_ref.file_path_in_image
    ):
        raise OSCValidationError(
            f"file {file.path}: imageRef needs both image and filePathInImage",
            field=f"{where}.content.imageRef",
            item=file.path,
        )


def _check_duplicate_paths(files: Sequence[File], host_name: str | None) -> None:
    seen: dict[str, list[str | None]] = {}
    for file in files:
        if host_name is not None and file.host_name not in (None, host_name):
            continue
        hosts = seen.setdefault(file.path, [])
        if any(_same_host(file.host_name, other) for other in hosts):
            target = f" on host {host_name}" if host_name else ""
            raise OSCValidationError(
                f"file {file.path} is defined more than once{target}", item=file.path
            )
        hosts.append(file.host_name)


def _same_host(a: str | None, b: str | None) -> bool:
    return a is None or b is None or a == b


def _locate(obj: Mapping[str, Any], loc: Iterable[int | str]) -> tuple[str, str | None]:
    """Render a pydantic error location as ``spec.files[2].content (/etc/foo)``."""
    text, item = "", None
    node: Any = obj
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
        if isinstance(part, int) and isinstance(node, dict):
            label = node.get("path") or node.get("name")
            if isinstance(label, str):
                item = label
    return (f"{text} ({item})" if item else text), item
