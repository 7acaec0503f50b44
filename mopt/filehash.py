"""Files as mopt sees them: BLAKE3 of bytes and of files, a file's tree mode, its stat
(`FileStat`) and the one racy-window rule, and durable replacement. The part of mopt the
no-op path needs (it runs before json, re or dataclasses are loaded)."""

from __future__ import annotations

import errno
import os
import stat

import blake3

#: files at least this large are hashed through mmap with several threads
MMAP_THRESHOLD = 4 * 1024 * 1024
#: the two modes a tree entry can have (git's choice: only the executable bit survives)
MODE_FILE = 0o644
MODE_EXEC = 0o755

StrPath = str | os.PathLike[str]

# BLAKE3's worker threads do not survive fork(): a child of a process that hashed with them
# (multiprocessing's default on Linux) deadlocks on the first threaded hash. Children of such
# a process hash on one thread instead.
_threads_started = False
_threads_lost = False


def _after_fork_in_child() -> None:
    global _threads_lost
    _threads_lost = _threads_lost or _threads_started


os.register_at_fork(after_in_child=_after_fork_in_child)


class NotRegularFileError(OSError):
    """A file mopt reads is a fifo, a socket or a device (a folder is IsADirectoryError)."""


def open_regular(path: StrPath, *, follow: bool = False) -> int:
    """A read-only descriptor of the regular file at `path`.

    Opened with O_NONBLOCK (a fifo in its place cannot block the open) and, unless `follow`,
    O_NOFOLLOW (a symbolic link is refused: ELOOP); NotRegularFileError when the descriptor is
    a fifo, socket or device (IsADirectoryError: a folder), checked with fstat before any read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        raise NotRegularFileError(errno.EINVAL, "not a regular file", os.fspath(path))
    return fd


def read_regular(path: StrPath, *, follow: bool = False) -> bytes:
    """The bytes of the regular file at `path` (see `open_regular`): never a blocking open."""
    with open(open_regular(path, follow=follow), "rb") as fh:
        return fh.read()


def hash_bytes(b: bytes | bytearray | memoryview) -> str:
    """BLAKE3 hex digest of `b`."""
    return blake3.blake3(b).hexdigest()


def hash_file(path: StrPath, *, size: int | None = None) -> str:
    """BLAKE3 hex digest of the file at `path`. `size`: its size as the caller just stat-ed
    it; a large one is mapped at once, without opening it here first (the digest is the
    same either way: only how the bytes are read depends on the size)."""
    if size is None or size < MMAP_THRESHOLD:
        with open(open_regular(path, follow=True), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < MMAP_THRESHOLD:
                return blake3.blake3(f.read()).hexdigest()
    # Large files: mmap avoids copying into Python and lets BLAKE3 hash on every core
    # (about 2x on two cores). mmap of an empty file would fail, hence the threshold first
    # (BLAKE3's update_mmap reads a file that is small by then, e.g. truncated meanwhile).
    global _threads_started
    if _threads_lost:
        h = blake3.blake3()
    else:
        _threads_started = True
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(os.fspath(path))
    return h.hexdigest()


def mode_of(st_mode: int) -> int:
    """The tree mode of a file: 0o755 if its owner may execute it, else 0o644."""
    return MODE_EXEC if st_mode & stat.S_IXUSR else MODE_FILE


#: what identifies a file's bytes without reading them: (device, inode, size, mtime_ns,
#: ctime_ns). ctime is in it because tar and mv can restore an old mtime on new bytes; the
#: kernel always sets ctime itself.
FileStat = tuple[int, int, int, int, int]

#: A file whose last change (ctime) is this close to the moment its stat was taken may change
#: again within the same timestamp tick without its stat changing ("racily clean", as git
#: calls it): its stat alone does not vouch for its bytes, its digest must be checked.
RACY_NS = 200_000_000


def file_stat(st: os.stat_result) -> FileStat:
    """The `FileStat` of an `os.stat` result."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def is_racy(fs: FileStat, taken_ns: int) -> bool:
    """Whether the stat `fs`, taken at `taken_ns` (time.time_ns()), may hide a later change."""
    return taken_ns - fs[4] < RACY_NS


def no_space(path: StrPath, doing: str, needed: int | None = None, name: str = "") -> str:
    """What a full disk (ENOSPC, EDQUOT) says: the disk of `path` (or `name`), what was being
    done, the bytes it needed and those free there."""
    from mopt.errors import human

    try:
        st = os.statvfs(path)
        free = f", {human(st.f_bavail * st.f_frsize)} free"
    except OSError:
        free = ""
    need = f"{human(needed)} needed" if needed is not None else "more space needed"
    return f"no space left on the disk of {name or os.fspath(path)} while {doing} ({need}{free})"


def replace_durably(path: str, data: bytes, mode: int = 0o644) -> None:
    """Put `data` at `path` through a temp file that is fsynced before the rename, and fsync
    the folder after it: a power cut leaves the old file or the new one, never an empty one
    (ext4/xfs may otherwise commit the rename before the data). A full disk is an OSError
    whose message says which and the bytes needed (`no_space`)."""
    import tempfile

    folder = os.path.dirname(path) or "."
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(e.errno, no_space(folder, f"writing {os.path.basename(path)}", len(data))) from None
        raise
    fsync_dir(folder)


def fsync_dir(path: StrPath) -> None:
    """fsync the folder `path` (a rename into it is durable once this returns)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
