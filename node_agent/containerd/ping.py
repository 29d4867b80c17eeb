"""Is containerd answering? One real gRPC call on its socket, without a gRPC library.

The health check asks containerd what upstream's check asks it: ``Version`` of the service
``containerd.services.version.v1.Version``. gRPC is HTTP/2, and a unary call with an empty request
needs very little of it: the connection preface, one (empty) SETTINGS frame, one HEADERS frame
whose header block uses only HPACK's static table and literals (no Huffman, no dynamic table), and
one DATA frame with the five-byte empty gRPC message. The answer is read frame by frame: a DATA
frame on the stream carries the length-prefixed ``VersionResponse`` (field 1: the version); the
stream ends with the trailers. A failed call (a gRPC error status) is trailers-only, without a
message, and counts as not answering; so does a reset stream, a GOAWAY before the answer, a
closed connection or no answer within the time limit.

Why not ``ctr version``: it would start a ~40 MB Go program every check (tens of ms of CPU on
the node, every 20 s), needs the binary and, in the test bed, a way into the node's namespaces.
Why not a bare ``connect()``: a hung containerd still accepts connections (the kernel's listen
backlog answers them), so that proves nothing; this call needs containerd's gRPC server to read,
dispatch and answer a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from dataclasses import dataclass

PATH = "/containerd.services.version.v1.Version/Version"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types and flags (RFC 9113).
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
STREAM = 1
MAX_FRAME = 1 << 20  # nothing containerd sends for this call comes near it
_SUN_PATH_MAX = 107  # sockaddr_un's path, without its terminating NUL


class PingError(Exception):
    """containerd did not answer the call (the message says how)."""


@dataclass(frozen=True)
class Version:
    version: str
    revision: str


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with an ``prefix_bits``-bit prefix, OR-ed into ``first``."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_str(text: str) -> bytes:
    raw = text.encode()
    return _hpack_int(len(raw), 7, 0x00) + raw  # H bit 0: a plain literal


def request_headers(authority: str = "localhost") -> bytes:
    """The header block of the call (static-table indexes from RFC 7541 appendix A)."""
    block = bytearray()
    block += b"\x83"  # :method POST (index 3)
    block += b"\x86"  # :scheme http (index 6)
    block += _hpack_int(4, 4, 0x00) + _hpack_str(PATH)  # :path, literal without indexing
    block += _hpack_int(1, 4, 0x00) + _hpack_str(authority)  # :authority
    block += _hpack_int(31, 4, 0x00) + _hpack_str("application/grpc")  # content-type
    block += b"\x00" + _hpack_str("te") + _hpack_str("trailers")
    block += _hpack_int(58, 4, 0x00) + _hpack_str("node-agent")  # user-agent
    return bytes(block)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream)


def request() -> bytes:
    """Everything the client sends up front: preface, SETTINGS, HEADERS, DATA (empty message)."""
    headers = request_headers()
    message = b"\x00" + struct.pack(">I", 0)  # not compressed, zero bytes (google.protobuf.Empty)
    return (
        PREFACE
        + frame(SETTINGS, 0, 0)
        + frame(HEADERS, END_HEADERS, STREAM, headers)
        + headers
        + frame(DATA, END_STREAM, STREAM, message)
        + message
    )


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise PingError("malformed protobuf varint in the answer")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def parse_version(message: bytes) -> Version:
    """``VersionResponse{string version = 1; string revision = 2}`` (other fields skipped)."""
    fields: dict[int, str] = {}
    pos = 0
    while pos < len(message):
        key, pos = _varint(message, pos)
        number, wire = key >> 3, key & 0x7
        if wire == 0:
            _, pos = _varint(message, pos)
        elif wire == 2:
            size, pos = _varint(message, pos)
            if pos + size > len(message):
                raise PingError("truncated protobuf field in the answer")
            fields[number] = message[pos : pos + size].decode(errors="replace")
            pos += size
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise PingError(f"unexpected protobuf wire type {wire} in the answer")
    if not fields.get(1):
        raise PingError("containerd answered without a version")
    return Version(fields[1], fields.get(2, ""))


def grpc_message(body: bytes) -> bytes:
    """The one length-prefixed gRPC message of a unary answer."""
    if len(body) < 5:
        raise PingError("containerd answered without a response message (a gRPC error status)")
    compressed, size = body[0], struct.unpack(">I", body[1:5])[0]
    if compressed:
        raise PingError("containerd answered with a compressed message")
    if len(body) < 5 + size:
        raise PingError("containerd's response message is truncated")
    return body[5 : 5 + size]


async def _open(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int | None]:
    """Connect to a unix socket; a path longer than ``sun_path`` goes through its directory's
    descriptor (``/proc/self/fd/N/<name>``), as a node's root seen from elsewhere may be long."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        reader, writer = await asyncio.open_unix_connection(path)
        return reader, writer, None
    directory, name = os.path.split(path)
    fd = os.open(directory or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        reader, writer = await asyncio.open_unix_connection(f"/proc/self/fd/{fd}/{name}")
    except BaseException:
        os.close(fd)
        raise
    return reader, writer, fd


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Version:
    writer.write(request())
    await writer.drain()
    body = bytearray()
    while True:
        try:
            header = await reader.readexactly(9)
        except asyncio.IncompleteReadError as exc:
            raise PingError("containerd closed the connection before answering") from exc
        size = int.from_bytes(header[:3], "big")
        kind, flags = header[3], header[4]
        stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
        if size > MAX_FRAME:
            raise PingError(f"containerd sent an oversized frame ({size} bytes)")
        try:
            payload = await reader.readexactly(size)
        except asyncio.IncompleteReadError as exc:
            raise PingError("containerd closed the connection in the middle of a frame") from exc
        if kind == SETTINGS and not flags & ACK:
            writer.write(frame(SETTINGS, ACK, 0))
        elif kind == PING and not flags & ACK:
            writer.write(frame(PING, ACK, 0, payload) + payload)
        elif kind == GOAWAY:
            code = int.from_bytes(payload[4:8], "big") if len(payload) >= 8 else -1
            raise PingError(f"containerd closed the connection (GOAWAY, code {code})")
        elif kind == RST_STREAM and stream == STREAM:
            code = int.from_bytes(payload[:4], "big") if len(payload) >= 4 else -1
            raise PingError(f"containerd reset the call (code {code})")
        elif kind == DATA and stream == STREAM:
            if flags & PADDED and payload:
                pad = payload[0]
                payload = payload[1 : len(payload) - pad] if pad < len(payload) else b""
            body += payload
        if stream == STREAM and kind in (DATA, HEADERS) and flags & END_STREAM:
            return parse_version(grpc_message(bytes(body)))


async def containerd_version(socket_path: str, seconds: float) -> Version:
    """Ask containerd on ``socket_path`` for its version within ``seconds``; raise
    :class:`PingError` (with a one-line reason) when it does not answer."""
    fd: int | None = None
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(seconds):
            try:
                reader, writer, fd = await _open(socket_path)
            except OSError as exc:
                raise PingError(f"cannot connect to {socket_path}: {exc.strerror or exc}") from exc
            try:
                return await _exchange(reader, writer)
            except OSError as exc:
                raise PingError(f"connection to {socket_path} failed: {exc}") from exc
    except TimeoutError as exc:
        raise PingError(f"no answer from {socket_path} within {seconds:g}s") from exc
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()
        if fd is not None:
            os.close(fd)
