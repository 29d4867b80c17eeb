"""HostFS: every read and write of a host path, under a ``--root`` prefix, crash-safe and exact.

Why a seam of its own: the agent runs as root and writes wherever an OperatingSystemConfig says,
so three properties must hold for every single write and are easiest to prove in one place:

- **No redirection.** Paths are walked one component at a time from a directory fd of the root
  (``openat`` with ``O_NOFOLLOW | O_DIRECTORY``), so a symlink planted anywhere in a parent chain
  (``/etc -> /outside``) is refused instead of followed, and there is no window between checking
  and using a path. Relative paths, ``..`` and NUL are refused before any I/O. Merged-/usr hosts
  have legitimate parent symlinks (``/lib -> usr/lib``, ``/var/run -> /run``):
  ``follow_system_symlinks=True`` follows those only when root (or the root directory's owner)
  owns the link and its directory is writable by nobody else, and resolves them *inside* the
  root like a chroot (an absolute target restarts at the root, ``..`` stops there), so even then
  nothing outside the root is reachable.
- **Atomic and durable.** Content goes to a temp file in the target's directory, gets its exact
  mode (``fchmod``, so the umask never matters), is fsynced and renamed over the target, and then
  the directory is fsynced: after a crash the target holds the old or the new bytes, never a mix.
  Temp files carry ``TEMP_PREFIX`` so ``cleanup_temp_files`` can remove leftovers.
- **Idempotent.** When the bytes and attributes on disk already match, nothing is written: the
  same OSC applied again costs zero writes and leaves every mtime alone. Removing what is already
  gone succeeds without any write-side syscall, so it works on a read-only mount too (``unlinkat``
  there fails with EROFS even for a missing name).
- **Only regular files are replaced.** A directory, device node, FIFO or socket at a target is
  refused, never silently swapped for a regular file; ``check_target`` tells the same before any
  write, so a whole change set can be checked first.
- **Bounded.** A walk holds at most three descriptors whatever the depth of the path, and a
  creating operation that fails removes the empty parents it created on the way.

All methods are synchronous: each is a handful of syscalls on small files. From asyncio, use the
``*_async`` wrappers, which run the whole operation in one ``asyncio.to_thread`` hop. (aiofiles
only offers path-based calls; the ``dir_fd``/``O_NOFOLLOW``/``fchmod``/directory-fsync sequence
that makes a write safe cannot be expressed with it, and one thread hop is cheaper than many.)
Not safe against a concurrent writer of the same path; the agent has one writer per path.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path, PurePath

from node_agent.base.errors import HostIOError, UnsafePathError

TEMP_PREFIX = ".node-agent-tmp-"
# Parent symlinks a distribution legitimately has (merged /usr, /var/run -> /run); with
# ``follow_system_symlinks`` only these are followed.
SYSTEM_SYMLINKS = frozenset(
    {"/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/var/run", "/var/lock", "/usr/tmp"}
)
DEFAULT_DIR_MODE = 0o755

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted at the target must not hang the agent.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
_MAX_SYMLINKS = 40
NAME_MAX = 255  # bytes per path component on Linux file systems
_TEMP_STEM = 80  # bytes of the target's name kept in a temp file's name

HostPath = str | PurePath


class WriteResult(enum.IntEnum):
    """What ``write_atomic`` did. Falsy only for ``UNCHANGED``, so ``if fs.write_atomic(...)``
    reads as "did anything change"."""

    UNCHANGED = 0
    CREATED = 1
    REPLACED = 2
    ATTRS_CHANGED = 3  # same bytes; mode and/or owner fixed in place (mtime untouched)


class Removed(enum.Enum):
    """What ``remove_written`` found at a path and did: only the file the agent wrote (a regular
    file with the recorded bytes) is removed; anything else there is left as it is."""

    REMOVED = "removed"
    ABSENT = "absent"
    OTHER_CONTENT = "its content is not what the agent wrote"
    SYMLINK = "is a symlink, not the file the agent wrote"
    SPECIAL = "is a FIFO, socket or device, not the file the agent wrote"


def _fault_point(name: str) -> None:
    """Hook for crash tests: called at named points of a write; does nothing in production."""


def host_parts(path: HostPath) -> tuple[str, ...]:
    """Split an absolute host path into its components, refusing anything that could escape."""
    text = os.fspath(path)
    if "\0" in text:
        raise UnsafePathError(text, "contains a NUL byte")
    if not text.startswith("/"):
        raise UnsafePathError(text, "is not absolute")
    parts = tuple(p for p in text.split("/") if p not in ("", "."))
    if ".." in parts:
        raise UnsafePathError(text, "contains '..'")
    return parts


class _NotADirectory(NotADirectoryError):
    """An existing component of a parent chain is not a directory; ``where`` is its host path."""

    def __init__(self, where: str) -> None:
        super().__init__(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        self.where = where


_KINDS = {
    stat.S_IFDIR: "is a directory",
    stat.S_IFCHR: "is a character device",
    stat.S_IFBLK: "is a block device",
    stat.S_IFIFO: "is a FIFO",
    stat.S_IFSOCK: "is a socket",
}


def _refuse_special(st: os.stat_result | None, path: HostPath) -> None:
    """Refuse a target that exists and is neither a regular file nor a symlink: replacing it
    would destroy a directory, device node, FIFO or socket that something else relies on."""
    if st is not None:
        reason = _KINDS.get(stat.S_IFMT(st.st_mode))
        if reason is not None:
            raise UnsafePathError(os.fspath(path), reason)


def _check_mode(mode: int, what: str) -> None:
    if not 0 <= mode <= 0o7777:
        raise ValueError(f"{what} {mode:#o} is not a permission mode (0..0o7777)")


@contextmanager
def _os_errors(op: str, path: HostPath) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise HostIOError(op, os.fspath(path), exc) from exc


class HostFS:
    """The host's file system below ``root``; host paths are absolute, e.g. ``/etc/hosts``."""

    def __init__(
        self, root: Path | str = Path("/"), *, follow_system_symlinks: bool = False
    ) -> None:
        self.root = Path(root)
        self.follow_system_symlinks = follow_system_symlinks

    def __repr__(self) -> str:
        return f"HostFS({str(self.root)!r})"

    # --- paths -----------------------------------------------------------------------------------

    def resolve(self, path: HostPath) -> Path:
        """The real path of host ``path`` under the root, after checking its existing parents
        (symlinked parents refused, or resolved inside the root when followed). For handing a
        path to other tools; this module's own operations never go through the returned path
        (they walk directory fds, which cannot race)."""
        parts = host_parts(path)
        if not parts:
            return self.root
        names: list[str] = []
        with _os_errors("resolve", path):
            fd = self._walk(path, parts[:-1], create=False, names=names)
        if fd is None:
            return self.root.joinpath(*parts)
        os.close(fd)
        return self.root.joinpath(*names, parts[-1])

    def lstat(self, path: HostPath) -> os.stat_result | None:
        """``lstat`` of host ``path`` (a final symlink is not followed); None if it is missing."""
        parts = self._target_parts(path)
        with _os_errors("stat", path), self._parent(path, parts, create=False) as dfd:
            return None if dfd is None else _lstat_at(dfd, parts[-1])

    def exists(self, path: HostPath) -> bool:
        return self.lstat(path) is not None

    def open_parent_dir(self, path: HostPath) -> int | None:
        """A read-only fd of the directory host ``path`` is in, opened by the same walk as
        every other operation (for watching it); None when it does not exist. The caller
        closes it."""
        parts = self._target_parts(path)
        with _os_errors("open", path):
            try:
                return self._walk(path, parts[:-1], create=False)
            except _NotADirectory:
                return None

    def list_dir(self, path: HostPath) -> list[str] | None:
        """Sorted entry names of host directory ``path``; None if it does not exist."""
        parts = host_parts(path)
        with _os_errors("list", path):
            fd = self._walk(path, parts, create=False)
            if fd is None:
                return None
            try:
                return sorted(os.listdir(fd))
            finally:
                os.close(fd)

    def check_target(self, path: HostPath) -> None:
        """Raise UnsafePathError if writing a regular file at ``path`` could not succeed or would
        destroy something that is not a regular file; creates nothing.

        Refused: a component longer than ``NAME_MAX`` bytes, an existing parent component that
        is not a directory, a symlinked parent (unless a trusted system link is followed), and a
        directory, device node, FIFO or socket at ``path`` itself. A missing parent is fine (the
        write creates it); a regular file or a symlink at ``path`` is fine (the write replaces
        it, never a symlink's target). Meant to be run over a whole change set before its first
        write, so a bad target fails the set instead of leaving it half applied.
        """
        parts = self._target_parts(path)
        for name in parts:
            size = len(os.fsencode(name))
            if size > NAME_MAX:
                raise UnsafePathError(
                    os.fspath(path),
                    f"component {name[:24]!r}... is {size} bytes long (the limit is {NAME_MAX})",
                )
        with _os_errors("check", path):
            try:
                dfd = self._walk(path, parts[:-1], create=False)
            except _NotADirectory as exc:
                raise UnsafePathError(
                    os.fspath(path), f"component {exc.where!r} is not a directory"
                ) from None
            if dfd is None:
                return
            try:
                _refuse_special(_lstat_at(dfd, parts[-1]), path)
            finally:
                os.close(dfd)

    # --- reading ---------------------------------------------------------------------------------

    def read(self, path: HostPath, *, limit: int | None = None) -> bytes | None:
        """The bytes of regular file ``path``; None if it is missing. A symlink, FIFO or other
        non-regular file at ``path`` is refused (UnsafePathError), and so is a file larger than
        ``limit`` bytes when given."""
        parts = self._target_parts(path)
        with _os_errors("read", path), self._parent(path, parts, create=False) as dfd:
            if dfd is None:
                return None
            return _read_regular(dfd, parts[-1], path, limit)

    def read_through_sibling_link(self, path: HostPath, *, limit: int) -> bytes | None:
        """The bytes of regular file ``path``, where a symlink at ``path`` is followed once to
        a regular file beside it (by its bare name or its full path in the same directory) and
        nowhere else: the kubelet keeps ``kubelet-client-current.pem`` as such a link to its
        dated certificate file. None if missing; any other link is refused (UnsafePathError),
        and so is a file larger than ``limit`` bytes."""
        parts = self._target_parts(path)
        with _os_errors("read", path), self._parent(path, parts, create=False) as dfd:
            if dfd is None:
                return None
            name = parts[-1]
            st = _lstat_at(dfd, name)
            if st is not None and stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=dfd)
                directory = "/" + "/".join(parts[:-1])
                head, sibling = os.path.split(target)
                if head not in ("", directory) or sibling in ("", ".", "..", name):
                    raise UnsafePathError(
                        os.fspath(path), f"is a symlink to {target!r}, not to a file beside it"
                    )
                name = sibling
            return _read_regular(dfd, name, path, limit)

    def stat_matches(
        self,
        path: HostPath,
        *,
        sha256: str | None = None,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
    ) -> bool:
        """True if ``path`` is a regular file with the given content digest and attributes.

        Only the given criteria are checked; a missing file, a symlink or anything that is not a
        regular file never matches. Used to detect drift without rewriting anything.
        """
        parts = self._target_parts(path)
        with _os_errors("check", path), self._parent(path, parts, create=False) as dfd:
            if dfd is None:
                return False
            try:
                fd = _open_regular(dfd, parts[-1], path)
            except UnsafePathError:
                return False
            if fd is None:
                return False
            try:
                st = os.fstat(fd)
                if not _attrs_match(st, mode, uid, gid):
                    return False
                if sha256 is None:
                    return True
                digest = hashlib.sha256()
                while chunk := os.read(fd, _CHUNK):
                    digest.update(chunk)
                return digest.hexdigest() == sha256.lower()
            finally:
                os.close(fd)

    # --- writing ---------------------------------------------------------------------------------

    def ensure_dir(
        self, path: HostPath, mode: int = DEFAULT_DIR_MODE, *, parent_mode: int = DEFAULT_DIR_MODE
    ) -> bool:
        """Create directory ``path`` (mode exactly ``mode``) and its missing parents (exactly
        ``parent_mode``). Existing directories keep their mode. Returns whether it was created."""
        _check_mode(mode, "directory mode")
        _check_mode(parent_mode, "directory mode")
        parts = self._target_parts(path)
        with (
            _os_errors("mkdir", path),
            self._parent(path, parts, create=True, dir_mode=parent_mode) as dfd,
        ):
            assert dfd is not None
            created = _mkdir_at(dfd, parts[-1], mode)
            os.close(_open_dir_at(dfd, parts[-1], path))  # refuses a symlink or a file there
            return created

    def write_atomic(
        self,
        path: HostPath,
        data: bytes,
        mode: int,
        *,
        dir_mode: int = DEFAULT_DIR_MODE,
        uid: int | None = None,
        gid: int | None = None,
    ) -> WriteResult:
        """Make ``path`` a regular file holding ``data`` with exactly ``mode`` (and owner, if
        given), atomically. Missing parents are created with exactly ``dir_mode``.

        Nothing is written when content and attributes already match; when only the mode or
        owner differ, they are fixed in place. A symlink at ``path`` itself is replaced (the
        link, never its target); a directory, device node, FIFO or socket there, or a parent
        component that is not a directory, is refused (UnsafePathError) before any change.
        """
        _check_mode(mode, "file mode")
        _check_mode(dir_mode, "directory mode")
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("write", path),
            self._parent(path, parts, create=True, dir_mode=dir_mode) as dfd,
        ):
            assert dfd is not None
            current = _lstat_at(dfd, name)
            _refuse_special(current, path)
            if (
                current is not None
                and stat.S_ISREG(current.st_mode)
                and current.st_size == len(data)
            ):
                same = _fix_attrs_if_same(dfd, name, path, data, mode, uid, gid)
                if same is not None:
                    return same
            tmp = self._write_temp(dfd, name, data, mode, uid, gid)
            try:
                _fault_point("before-rename")
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                _unlink_quietly(dfd, tmp)
                raise
            _fault_point("after-rename")
            os.fsync(dfd)
            return WriteResult.CREATED if current is None else WriteResult.REPLACED

    def symlink_atomic(
        self, path: HostPath, target: str, *, dir_mode: int = DEFAULT_DIR_MODE
    ) -> bool:
        """Make ``path`` a symlink to ``target`` (not interpreted), atomically; returns whether
        anything changed. A regular file or symlink at ``path`` is replaced; a directory, device
        node, FIFO or socket is refused (UnsafePathError)."""
        if "\0" in target or not target:
            raise UnsafePathError(target, "is not a valid symlink target")
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("symlink", path),
            self._parent(path, parts, create=True, dir_mode=dir_mode) as dfd,
        ):
            assert dfd is not None
            current = _lstat_at(dfd, name)
            _refuse_special(current, path)
            if (
                current is not None
                and stat.S_ISLNK(current.st_mode)
                and os.readlink(name, dir_fd=dfd) == target
            ):
                return False
            tmp = _temp_name(name)
            os.symlink(target, tmp, dir_fd=dfd)
            try:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                _unlink_quietly(dfd, tmp)
                raise
            os.fsync(dfd)
            return True

    # --- removing --------------------------------------------------------------------------------

    def keep_previous(
        self, path: HostPath, suffix: str = ".previous", *, keep_as: str | None = None
    ) -> bool:
        """Keep the regular file at ``path`` as ``<path><suffix>`` (or as ``keep_as``, a name
        in the same directory) before it is replaced: a hard link (no copy), swapped in
        atomically over an older one. Returns whether a copy was kept (False when ``path`` is
        missing or not a regular file)."""
        if keep_as is not None and (not keep_as or "/" in keep_as or keep_as in (".", "..")):
            raise UnsafePathError(keep_as, "is not a file name")
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("keep previous of", path),
            self._parent(path, parts, create=False) as dfd,
        ):
            if dfd is None:
                return False
            current = _lstat_at(dfd, name)
            if current is None or not stat.S_ISREG(current.st_mode):
                return False
            temp = _temp_name(name)
            os.link(name, temp, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            try:
                os.rename(temp, keep_as or name + suffix, src_dir_fd=dfd, dst_dir_fd=dfd)
            except OSError:
                with suppress(OSError):
                    os.unlink(temp, dir_fd=dfd)
                raise
            os.fsync(dfd)
            return True

    def remove(self, path: HostPath) -> bool:
        """Remove the file or symlink at ``path`` (never what a symlink points to); returns
        whether something was removed. A directory there is an error.

        Something already gone is success: a missing path, a missing parent or a parent that is
        not a directory returns False after reads only, so it works on a read-only mount."""
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("remove", path),
            self._parent(path, parts, create=False, absent_if_not_dir=True) as dfd,
        ):
            if dfd is None:
                return False
            current = _lstat_at(dfd, name)
            if current is None:
                return False
            if stat.S_ISDIR(current.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return False
            os.fsync(dfd)
            return True

    def remove_written(self, path: HostPath, sha256: str) -> Removed:
        """Remove the regular file at ``path`` only if its bytes have digest ``sha256`` (what
        the agent recorded when it wrote them); anything else there stays (``Removed`` says
        what). The digest is read from the very file then unlinked (same inode, checked again
        just before), so a file swapped in meanwhile is not removed either.

        A missing path, a missing parent or a parent that is not a directory is ``ABSENT``
        (reads only); a directory at ``path`` and a symlinked parent are errors (HostError)."""
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("remove", path),
            self._parent(path, parts, create=False, absent_if_not_dir=True) as dfd,
        ):
            current = None if dfd is None else _lstat_at(dfd, name)
            if dfd is None or current is None:
                return Removed.ABSENT
            if stat.S_ISDIR(current.st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            if stat.S_ISLNK(current.st_mode):
                return Removed.SYMLINK
            if not stat.S_ISREG(current.st_mode):
                return Removed.SPECIAL
            try:
                fd = _open_regular(dfd, name, path)
            except UnsafePathError:  # replaced by a symlink or a FIFO since the lstat
                return Removed.SPECIAL
            if fd is None:
                return Removed.ABSENT
            try:
                st = os.fstat(fd)
                digest = hashlib.sha256()
                while chunk := os.read(fd, _CHUNK):
                    digest.update(chunk)
            finally:
                os.close(fd)
            if digest.hexdigest() != sha256.lower():
                return Removed.OTHER_CONTENT
            again = _lstat_at(dfd, name)
            if again is None:
                return Removed.ABSENT
            if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino):
                return Removed.OTHER_CONTENT  # another file took the name meanwhile
            os.unlink(name, dir_fd=dfd)
            os.fsync(dfd)
            return Removed.REMOVED

    def remove_tree(self, path: HostPath) -> bool:
        """Remove directory ``path`` and everything in it; returns whether it existed. The walk
        to it follows no symlink (as every other operation), nor does the removal inside it
        (``shutil.rmtree`` on a directory fd: a symlink inside is removed, never followed). A
        symlink or anything else that is not a directory at ``path`` is refused
        (UnsafePathError), never followed."""
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("remove", path),
            self._parent(path, parts, create=False, absent_if_not_dir=True) as dfd,
        ):
            current = None if dfd is None else _lstat_at(dfd, name)
            if dfd is None or current is None:
                return False
            if not stat.S_ISDIR(current.st_mode):
                kind = "a symlink" if stat.S_ISLNK(current.st_mode) else "not a directory"
                raise UnsafePathError(os.fspath(path), f"is {kind}")
            shutil.rmtree(name, dir_fd=dfd)
            os.fsync(dfd)
            return True

    def move_aside(self, path: HostPath, suffix: str) -> os.stat_result | None:
        """Rename whatever is at ``path`` (a file, a symlink, a directory, a FIFO, a device) to
        ``<path><suffix>`` in the same directory, durably, without opening or following it; an
        older entry of any kind at the new name is removed first (a directory tree without
        following a symlink inside it). Returns the ``lstat`` of what was moved, None if there
        was nothing. For setting an unusable file aside so it is absent from then on."""
        if not suffix or "/" in suffix or "\0" in suffix:
            raise UnsafePathError(suffix, "is not a file name suffix")
        parts = self._target_parts(path)
        name, aside = parts[-1], parts[-1] + suffix
        with _os_errors("move aside", path), self._parent(path, parts, create=False) as dfd:
            current = None if dfd is None else _lstat_at(dfd, name)
            if dfd is None or current is None:
                return None
            old = _lstat_at(dfd, aside)
            if old is not None and stat.S_ISDIR(old.st_mode):
                shutil.rmtree(aside, dir_fd=dfd)  # fd-based: no symlink inside is followed
            elif old is not None:
                os.unlink(aside, dir_fd=dfd)
            os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
            return current

    def remove_dir_if_empty(self, path: HostPath) -> bool:
        """Remove directory ``path`` if it exists and is empty; returns whether it was removed.

        Tidying, so anything else returns False: a missing or non-directory path, a directory
        with entries or one in use as a mount point. Only an empty directory is ever handed to
        ``rmdir``, so the missing and non-empty cases work on a read-only mount too."""
        parts = self._target_parts(path)
        name = parts[-1]
        with (
            _os_errors("rmdir", path),
            self._parent(path, parts, create=False, absent_if_not_dir=True) as dfd,
        ):
            if dfd is None:
                return False
            current = _lstat_at(dfd, name)
            if current is None or not stat.S_ISDIR(current.st_mode):
                return False
            try:
                fd = _open_dir_at(dfd, name, path)
            except (FileNotFoundError, NotADirectoryError, UnsafePathError):
                return False  # replaced since the lstat
            try:
                with os.scandir(fd) as entries:
                    if next(entries, None) is not None:
                        return False
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=dfd)
            except OSError as exc:
                if exc.errno in (
                    errno.ENOENT,
                    errno.ENOTEMPTY,
                    errno.EEXIST,
                    errno.ENOTDIR,
                    errno.EBUSY,
                ):
                    return False
                raise
            os.fsync(dfd)
            return True

    def chmod(self, path: HostPath, mode: int) -> bool:
        """Set the mode of existing regular file ``path`` to exactly ``mode`` without rewriting
        it (no new inode, mtime untouched, so nothing watching the content sees a change);
        returns whether the mode changed. Used to repair drift of attributes alone.

        A symlink at ``path`` is refused, never followed, as is anything else that is not a
        regular file (UnsafePathError); a missing file is a HostIOError (ENOENT)."""
        _check_mode(mode, "file mode")
        parts = self._target_parts(path)
        name = parts[-1]
        with _os_errors("chmod", path), self._parent(path, parts, create=False) as dfd:
            current = None if dfd is None else _lstat_at(dfd, name)
            if dfd is None or current is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            if stat.S_ISLNK(current.st_mode):
                raise UnsafePathError(os.fspath(path), "is a symlink")
            if not stat.S_ISREG(current.st_mode):
                raise UnsafePathError(os.fspath(path), "is not a regular file")
            # fchmodat(AT_SYMLINK_NOFOLLOW) is not a syscall on Linux (glibc emulates it through
            # /proc); an fd opened without following, checked to be a regular file, is portable.
            fd = _open_regular(dfd, name, path)
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
            try:
                if stat.S_IMODE(os.fstat(fd).st_mode) == mode:
                    return False
                os.fchmod(fd, mode)
                os.fsync(fd)
                return True
            finally:
                os.close(fd)

    def cleanup_temp_files(self, dirs: Iterable[HostPath]) -> list[str]:
        """Remove leftover ``TEMP_PREFIX`` files from host directories ``dirs`` (not recursive)
        after a crash; returns the host paths removed. Missing directories are skipped. Run it
        before applying, never while a write into the same directory is in flight."""
        removed: list[str] = []
        for directory in dict.fromkeys(os.fspath(d) for d in dirs):
            parts = host_parts(directory)
            with _os_errors("cleanup", directory):
                names: list[str] = []
                fd = self._walk(directory, parts, create=False, names=names)
                if fd is None:
                    continue
                try:
                    found = False
                    for name in os.listdir(fd):
                        st = _lstat_at(fd, name) if name.startswith(TEMP_PREFIX) else None
                        if st is None or stat.S_ISDIR(st.st_mode):
                            continue
                        os.unlink(name, dir_fd=fd)
                        removed.append("/" + "/".join((*names, name)))
                        found = True
                    if found:
                        os.fsync(fd)
                finally:
                    os.close(fd)
        return sorted(removed)

    # --- asyncio ---------------------------------------------------------------------------------

    async def write_atomic_async(
        self,
        path: HostPath,
        data: bytes,
        mode: int,
        *,
        dir_mode: int = DEFAULT_DIR_MODE,
        uid: int | None = None,
        gid: int | None = None,
    ) -> WriteResult:
        return await asyncio.to_thread(
            self.write_atomic, path, data, mode, dir_mode=dir_mode, uid=uid, gid=gid
        )

    async def read_async(self, path: HostPath, *, limit: int | None = None) -> bytes | None:
        return await asyncio.to_thread(self.read, path, limit=limit)

    async def remove_async(self, path: HostPath) -> bool:
        return await asyncio.to_thread(self.remove, path)

    # --- internals -------------------------------------------------------------------------------

    def _target_parts(self, path: HostPath) -> tuple[str, ...]:
        parts = host_parts(path)
        if not parts:
            raise UnsafePathError(os.fspath(path), "is the root directory itself")
        if parts[-1].startswith(TEMP_PREFIX):
            raise UnsafePathError(os.fspath(path), f"names starting {TEMP_PREFIX!r} are reserved")
        return parts

    @contextmanager
    def _parent(
        self,
        path: HostPath,
        parts: tuple[str, ...],
        *,
        create: bool,
        dir_mode: int = DEFAULT_DIR_MODE,
        absent_if_not_dir: bool = False,
    ) -> Iterator[int | None]:
        """A directory fd of the parent of ``parts[-1]``; None when a parent is missing and
        ``create`` is false (or, with ``absent_if_not_dir``, when one is not a directory).

        Directories created for this call are removed again (innermost first, best effort) if
        the body fails, so a failed write leaves no trail of empty parents behind."""
        made: set[tuple[int, int]] = set()
        names: list[str] = []
        try:
            fd = self._walk(
                path, parts[:-1], create=create, dir_mode=dir_mode, names=names, created=made
            )
        except _NotADirectory:
            if not absent_if_not_dir:
                raise
            fd = None
        try:
            yield fd
        except BaseException:
            if made and fd is not None:
                _remove_created(fd, names, made)
            raise
        finally:
            if fd is not None:
                os.close(fd)

    def _walk(
        self,
        path: HostPath,
        dirs: tuple[str, ...],
        *,
        create: bool,
        dir_mode: int = DEFAULT_DIR_MODE,
        names: list[str] | None = None,
        created: set[tuple[int, int]] | None = None,
    ) -> int | None:
        """Open ``root/dirs...`` one component at a time. A symlinked component is refused, or
        with ``follow_system_symlinks`` resolved inside the root if trusted. ``names`` receives
        the canonical components of the directory opened, ``created`` the (st_dev, st_ino) of
        each directory created on the way.

        Holds the root's fd, the current directory's and, briefly, its child's, whatever the
        depth: a ``..`` from a link target reopens the shortened canonical chain from the root
        rather than keeping an fd per level. An existing component that is not a directory
        raises UnsafePathError when creating, else ``_NotADirectory``. If the walk itself fails
        after creating directories, it removes them again (innermost first, best effort)."""
        made: set[tuple[int, int]] = set() if created is None else created
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fd = root_fd  # the directory named by ``canonical``
        canonical: list[str] = []
        todo = list(reversed(dirs))
        hops = 0
        keep = -1  # the fd handed to the caller, not closed here
        try:
            while todo:
                name = todo.pop()
                if name == "..":  # only from a symlink target; clamped at the root
                    if canonical:
                        canonical.pop()
                        current, fd = fd, root_fd  # _reopen closes ``current`` in any case
                        fd = self._reopen(root_fd, current, canonical, path)
                    continue
                try:
                    child = _open_dir_at(fd, name, path)
                except FileNotFoundError:
                    if not create:
                        return None
                    child = _make_dir_at(fd, name, dir_mode, path, made)
                except NotADirectoryError:
                    where = "/" + "/".join([*canonical, name])
                    if create:
                        raise UnsafePathError(
                            os.fspath(path), f"component {where!r} is not a directory"
                        ) from None
                    raise _NotADirectory(where) from None
                except UnsafePathError:
                    if not self.follow_system_symlinks:
                        raise
                    target = self._trusted_link(root_fd, fd, canonical, name, path)
                    hops += 1
                    if hops > _MAX_SYMLINKS:
                        raise UnsafePathError(os.fspath(path), "too many symlinks") from None
                    if target.startswith("/"):  # re-anchored at the root, like a chroot
                        if fd != root_fd:
                            os.close(fd)
                            fd = root_fd
                        canonical.clear()
                    todo.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                    continue
                if fd != root_fd:
                    os.close(fd)
                fd = child
                canonical.append(name)
            if names is not None:
                names[:] = canonical
            keep = fd
            return fd
        except BaseException:
            if made:
                _remove_created(fd, canonical if fd != root_fd else [], made)
            raise
        finally:
            if fd not in (keep, root_fd):
                os.close(fd)
            if root_fd != keep:
                os.close(root_fd)

    def _reopen(self, root_fd: int, fd: int, canonical: list[str], path: HostPath) -> int:
        """Close ``fd`` and open ``root/canonical...`` afresh (symlinks refused: every name was
        a real directory moments ago, a link there now is someone racing the walk)."""
        if fd != root_fd:
            os.close(fd)
        fd = root_fd
        try:
            for name in canonical:
                child = _open_dir_at(fd, name, path)
                if fd != root_fd:
                    os.close(fd)
                fd = child
        except BaseException:
            if fd != root_fd:
                os.close(fd)
            raise
        return fd

    def _trusted_link(
        self, root_fd: int, dir_fd: int, canonical: list[str], name: str, path: HostPath
    ) -> str:
        """The target of symlink ``name``, if it is one of the distribution's own layout links
        (``SYSTEM_SYMLINKS``) and only root (or the root directory's owner) could have placed
        it: owned by them, in a directory nobody else may write to. Any other symlink in a
        parent chain, e.g. one planted under ``/etc``, is refused."""
        where = "/" + "/".join([*canonical, name])
        if where not in SYSTEM_SYMLINKS:
            raise UnsafePathError(
                os.fspath(path), f"component {where!r} is a symlink (not a system layout link)"
            )
        link = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        parent = os.fstat(dir_fd)
        trusted = {0, os.fstat(root_fd).st_uid}
        if link.st_uid not in trusted or parent.st_uid not in trusted or parent.st_mode & 0o022:
            raise UnsafePathError(
                os.fspath(path), f"component {name!r} is a symlink others could have planted"
            )
        return os.readlink(name, dir_fd=dir_fd)

    def _write_temp(
        self,
        dfd: int,
        name: str,
        data: bytes,
        mode: int,
        uid: int | None,
        gid: int | None,
    ) -> str:
        tmp = _temp_name(name)
        fd = os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=dfd)
        try:
            try:
                _fault_point("temp-created")
                if uid is not None or gid is not None:
                    os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
                os.fchmod(fd, mode)  # after fchown, which clears set-id bits
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                _fault_point("temp-written")
                os.fsync(fd)
                _fault_point("after-fsync")
            finally:
                os.close(fd)
        except BaseException:
            _unlink_quietly(dfd, tmp)
            raise
        return tmp


def _temp_name(name: str) -> str:
    """A fresh temp name next to ``name``; its stem is cut by bytes, not characters, so a target
    name that fits in ``NAME_MAX`` bytes always gets a temp name that fits too."""
    stem = name[:_TEMP_STEM]
    while len(os.fsencode(stem)) > _TEMP_STEM:
        stem = stem[:-1]
    return f"{TEMP_PREFIX}{secrets.token_hex(6)}-{stem}"


def _lstat_at(dfd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _mkdir_at(dfd: int, name: str, mode: int) -> bool:
    """Create directory ``name`` with exactly ``mode``; False if something already exists."""
    try:
        os.mkdir(name, 0o700, dir_fd=dfd)
    except FileExistsError:
        return False
    fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    os.fsync(dfd)
    return True


def _make_dir_at(dfd: int, name: str, mode: int, path: HostPath, made: set[tuple[int, int]]) -> int:
    """Create directory ``name`` with exactly ``mode`` and return an fd of it, recording its
    identity in ``made``; if someone else created it first, open theirs (not recorded)."""
    try:
        os.mkdir(name, 0o700, dir_fd=dfd)
    except FileExistsError:
        return _open_dir_at(dfd, name, path)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except BaseException:
        with suppress(OSError):
            os.rmdir(name, dir_fd=dfd)
        raise
    key = (-1, -1)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        made.add(key)
        os.fchmod(fd, mode)
        os.fsync(dfd)
    except BaseException:
        os.close(fd)
        with suppress(OSError):
            os.rmdir(name, dir_fd=dfd)
            made.discard(key)
        raise
    return fd


def _remove_created(fd: int, names: list[str], made: set[tuple[int, int]]) -> None:
    """Best effort: remove the directories of ``made`` on the chain that ends at ``fd`` (the
    directory ``names`` leads to), innermost first, while they are empty. Goes up by ``..`` and
    removes a directory only if its parent still holds it under the expected name."""
    try:
        here = os.open(".", _DIR_FLAGS, dir_fd=fd)
    except OSError:
        return
    depth = len(names)
    removed = False
    try:
        while depth:
            st = os.fstat(here)
            key = (st.st_dev, st.st_ino)
            if key not in made:
                break
            parent = os.open("..", _DIR_FLAGS, dir_fd=here)
            os.close(here)
            here = parent
            depth -= 1
            entry = _lstat_at(here, names[depth])
            if entry is None or (entry.st_dev, entry.st_ino) != key:
                break
            os.rmdir(names[depth], dir_fd=here)
            made.discard(key)
            removed = True
        if removed:
            os.fsync(here)
    except OSError:
        pass
    finally:
        os.close(here)


def _open_dir_at(dfd: int, name: str, path: HostPath) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dfd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = _lstat_at(dfd, name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(os.fspath(path), f"component {name!r} is a symlink") from exc
        raise


def _read_regular(dfd: int, name: str, path: HostPath, limit: int | None) -> bytes | None:
    """The bytes of regular file ``name`` in ``dfd`` (None if missing), refused when larger
    than ``limit`` bytes (when given)."""
    fd = _open_regular(dfd, name, path)
    if fd is None:
        return None
    try:
        if limit is None:
            return _read_all(fd)
        if os.fstat(fd).st_size > limit:
            raise UnsafePathError(os.fspath(path), f"is larger than {limit} bytes")
        data = _read_all(fd, limit + 1)
        if len(data) > limit:
            raise UnsafePathError(os.fspath(path), f"is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def _open_regular(dfd: int, name: str, path: HostPath) -> int | None:
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(os.fspath(path), "is a symlink") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(os.fspath(path), "is not a regular file")
    return fd


def _read_all(fd: int, limit: int | None = None) -> bytes:
    """Everything from ``fd``, or its first ``limit`` bytes."""
    chunks = []
    left = limit
    while left is None or left > 0:
        chunk = os.read(fd, _CHUNK if left is None else min(_CHUNK, left))
        if not chunk:
            break
        chunks.append(chunk)
        if left is not None:
            left -= len(chunk)
    return b"".join(chunks)


def _attrs_match(st: os.stat_result, mode: int | None, uid: int | None, gid: int | None) -> bool:
    return (
        (mode is None or stat.S_IMODE(st.st_mode) == mode)
        and (uid is None or st.st_uid == uid)
        and (gid is None or st.st_gid == gid)
    )


def _fix_attrs_if_same(
    dfd: int,
    name: str,
    path: HostPath,
    data: bytes,
    mode: int,
    uid: int | None,
    gid: int | None,
) -> WriteResult | None:
    """If ``name`` already holds ``data``, fix its attributes in place and say what happened;
    None if the content differs (the caller then replaces the file)."""
    fd = _open_regular(dfd, name, path)
    if fd is None:
        return None
    try:
        if _read_all(fd) != data:
            return None
        st = os.fstat(fd)
        if _attrs_match(st, mode, uid, gid):
            return WriteResult.UNCHANGED
        if (uid is not None and st.st_uid != uid) or (gid is not None and st.st_gid != gid):
            os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
        os.fchmod(fd, mode)
        os.fsync(fd)
        return WriteResult.ATTRS_CHANGED
    finally:
        os.close(fd)


def _unlink_quietly(dfd: int, name: str) -> None:
    with suppress(OSError):
        os.unlink(name, dir_fd=dfd)
