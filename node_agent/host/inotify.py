"""Wake-ups when a file's name leaves its directory, from the kernel's inotify.

The token files must be put back as soon as something deletes them (an OSC apply that removes
an orphaned path, an operator, a cleanup job). Polling their existence every few seconds was
the idle agent's largest cost; with a watch on each file's directory the kernel says when it
happens and an idle agent makes no call at all. A wake-up is only a hint: the caller still
checks the file with its own safe walk, and a slow periodic check stays behind it.

The directory is opened by :class:`~node_agent.host.fs.HostFS`'s walk (no symlinked parent
followed) and watched through ``/proc/self/fd``, so the watch is on exactly the directory the
writes go to. Where inotify is unavailable (no ``/proc``, the per-user instance or watch limit
reached, a kernel without it) :meth:`RemovalWatch.arm` says so and the caller keeps polling.
The system calls go through :mod:`ctypes` on the C library the interpreter already uses; no
package was worth adding for three calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable

from node_agent.base.errors import HostError
from node_agent.base.log import get_logger
from node_agent.host.fs import HostFS, HostPath, host_parts

log = get_logger("node-agent.inotify")

IN_MOVED_FROM = 0x00000040
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

#: what a directory's watch reports: a name deleted or renamed away, the directory itself gone
MASK = IN_MOVED_FROM | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR
#: events after which every name of the watch is looked at again (its directory is gone, moved,
#: unmounted, or the kernel dropped events)
EVERYTHING = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED | IN_Q_OVERFLOW
HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event)


class _Libc:
    """The three inotify calls, bound once."""

    def __init__(self) -> None:
        import ctypes  # here: a start that arms no watch yet does not pay for it

        libc = ctypes.CDLL(None, use_errno=True)
        self.init1 = libc.inotify_init1
        self.init1.argtypes = [ctypes.c_int]
        self.init1.restype = ctypes.c_int
        self.add_watch = libc.inotify_add_watch
        self.add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self.add_watch.restype = ctypes.c_int
        self.rm_watch = libc.inotify_rm_watch
        self.rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self.rm_watch.restype = ctypes.c_int


def _os_error(what: str) -> OSError:
    import ctypes

    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


class RemovalWatch:
    """One inotify instance for any number of files; ``on_removed`` callbacks by name.

    Built lazily on the running loop by the first :meth:`arm`; :meth:`close` ends it."""

    def __init__(self) -> None:
        self._libc: _Libc | None = None
        self._fd: int | None = None
        self._failed: str | None = None  # why inotify cannot be used in this process
        # watch descriptor -> {file name in that directory -> callbacks}
        self._names: dict[int, dict[str, list[Callable[[], None]]]] = {}
        self._armed: dict[str, int] = {}  # host path -> the watch descriptor covering it

    @property
    def unavailable(self) -> str | None:
        """Why no watch can be armed in this process (None: it can)."""
        return self._failed

    def arm(self, fs: HostFS, path: HostPath, on_removed: Callable[[], None]) -> str | None:
        """Watch host ``path``'s directory for ``path`` leaving it; ``on_removed`` is called
        (on the loop) when it does, or when the watch itself ends (then arm again). Arming
        the same path and callback again is cheap and changes nothing. Returns None when the
        watch is in place, else why not (the caller polls instead)."""
        if self._failed is not None:
            return self._failed
        parts = host_parts(path)
        if not parts:
            return "no file name"
        try:
            fd = self._instance()
        except OSError as exc:
            self._failed = f"inotify unavailable ({exc.strerror or exc})"
            log.info("files watched by polling", reason=self._failed)
            return self._failed
        try:
            dfd = fs.open_parent_dir(path)
        except HostError as exc:
            return str(exc)
        if dfd is None:
            return "its directory does not exist"
        try:
            assert self._libc is not None
            wd = self._libc.add_watch(fd, f"/proc/self/fd/{dfd}".encode(), MASK)
            if wd < 0:  # e.g. ENOSPC: the per-user watch limit reached
                return str(_os_error(f"watch of {path}'s directory"))
        finally:
            os.close(dfd)
        self._armed[os.fspath(path)] = wd
        callbacks = self._names.setdefault(wd, {}).setdefault(parts[-1], [])
        if on_removed not in callbacks:
            callbacks.append(on_removed)
        return None

    def watching(self, path: HostPath) -> bool:
        """Whether a watch for ``path``'s name is in place (it goes when its directory goes)."""
        return os.fspath(path) in self._armed

    def close(self) -> None:
        fd, self._fd = self._fd, None
        self._names.clear()
        self._armed.clear()
        if fd is None:
            return
        with contextlib.suppress(RuntimeError):  # no loop any more: the fd closes all the same
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def _instance(self) -> int:
        if self._fd is None:
            if self._libc is None:
                self._libc = _Libc()
            fd = self._libc.init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd < 0:
                raise _os_error("inotify_init1")
            asyncio.get_running_loop().add_reader(fd, self._readable)
            self._fd = fd
        return self._fd

    def _readable(self) -> None:
        assert self._fd is not None
        try:
            buffer = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as exc:  # the instance broke: every watched name is looked at, then polled
            self._failed = f"inotify read failed ({exc.strerror or exc})"
            log.warning("file watch ended; polling instead", reason=self._failed)
            callbacks = [c for names in self._names.values() for cs in names.values() for c in cs]
            self.close()
            for callback in callbacks:
                callback()
            return
        for callback in self._due(buffer):
            callback()

    def _due(self, buffer: bytes) -> list[Callable[[], None]]:
        """The callbacks the events in ``buffer`` call for, each once; watches that ended are
        forgotten (their names must be armed again)."""
        due: list[Callable[[], None]] = []
        offset = 0
        while offset + HEADER.size <= len(buffer):
            wd, mask, _cookie, length = HEADER.unpack_from(buffer, offset)
            offset += HEADER.size
            name = buffer[offset : offset + length].split(b"\0", 1)[0].decode(errors="replace")
            offset += length
            if mask & IN_Q_OVERFLOW:
                due += [c for names in self._names.values() for cs in names.values() for c in cs]
                continue
            names = self._names.get(wd)
            if names is None:
                continue
            if mask & EVERYTHING:
                due += [c for cs in names.values() for c in cs]
                if mask & IN_IGNORED:
                    del self._names[wd]
                    self._armed = {p: w for p, w in self._armed.items() if w != wd}
                elif mask & IN_MOVE_SELF and self._fd is not None and self._libc is not None:
                    # the directory moved away: this watch no longer covers the path
                    self._libc.rm_watch(self._fd, wd)  # its IN_IGNORED follows
                continue
            due += names.get(name, [])
        return list(dict.fromkeys(due))
