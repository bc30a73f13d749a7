"""HDF5 files that read only themselves, and a lock for the one process writing a file.

[Note: self-contained HDF5]
A file handed to hpcsplit (a profile, batch inputs) may have been written by someone else.  HDF5 can
make a read reach other files: external links (a group or dataset in another file), virtual datasets
(data mapped from other files) and external raw storage (a dataset's bytes in a plain file such as
``/etc/passwd``).  :func:`open_self_contained` opens a file read-only and refuses it when any object
uses one of these, before any data is read; soft links are resolved inside the file and a dangling one
is refused too.  The error names the file and the object, and says nothing about what the link points at.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

__all__ = ["WriterLock", "open_self_contained", "outside_references"]


def outside_references(f: Any) -> list[str]:
    """Every object of the open h5py file ``f`` that reads outside it (``"/a/b: external link"``)."""
    import h5py

    found: list[str] = []
    seen: set[Any] = set()

    def walk(group: Any, prefix: str) -> None:
        for name in group:
            path = f"{prefix}/{name}"
            link = group.get(name, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                found.append(f"{path}: external link")
                continue
            if isinstance(link, h5py.SoftLink) and group.get(name) is None:
                found.append(f"{path}: dangling soft link")
                continue
            obj = group.get(name)
            if isinstance(obj, h5py.Dataset):
                if obj.is_virtual:
                    found.append(f"{path}: virtual dataset")
                elif obj.external:
                    found.append(f"{path}: external raw storage")
            elif isinstance(obj, h5py.Group):
                key = obj.id.__hash__()
                if key in seen:  # a hard or soft link back up the tree: walked already
                    continue
                seen.add(key)
                walk(obj, path)

    walk(f, "")
    return found


def open_self_contained(path: str | Path, error: Callable[[str], Exception], what: str = "HDF5 file") -> Any:
    """Open ``path`` read-only with h5py after checking it reads nothing outside itself.

    Parameters
    ----------
    path : path
        The HDF5 file.
    error : callable
        Builds the exception to raise from a message (the caller's error class).
    what : str
        What the file should be, in messages ("profile", "batch input").

    Raises
    ------
    Exception
        ``error(msg)`` when the file cannot be opened or any object reaches outside it.
    """
    import h5py

    path = Path(path)
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise error(f"{path}: cannot be opened as HDF5 ({e}); the file is truncated or not a {what}") from e
    try:
        bad = outside_references(f)
    except Exception as e:  # a damaged object table
        f.close()
        raise error(f"{path}: its objects cannot be listed ({type(e).__name__}: {e}); the file is damaged") from e
    if bad:
        f.close()
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise error(
            f"{path}: refused, it reads data outside itself ({shown}); hpcsplit reads only self-contained "
            "HDF5 files: copy the data into the file (h5py: dataset[...] into a new file) and pass that"
        )
    return f


class WriterLock:
    """An exclusive advisory lock on ``<file>.lock`` held while one process writes ``file``.

    A second writer gets ``error(msg)`` at once instead of both writing.  The lock file stays (removing
    it would let a third writer lock a new file while the second still holds the old one); it records
    the holder's PID and host.  On file systems without ``flock`` (some parallel file systems), the lock
    is skipped with a warning on stderr.
    """

    def __init__(self, path: str | Path, error: Callable[[str], Exception], what: str = "file") -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self._error = error
        self._what = what
        self._fd: int | None = None

    def acquire(self) -> Self:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:  # never through a symlink planted in a shared folder, and only a regular file
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise self._error(f"{self.path}: cannot open its lock file {self.lock_path} ({e.strerror}); "
                              "remove it if it is a symlink or not a file, or write to another folder") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._error(f"{self.path}: its lock file {self.lock_path} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._error(
                    f"{self.path}: another process is writing this {self._what} (it holds {self.lock_path}); "
                    "wait for it to finish, or write to another file"
                ) from None
            print(f"[hpcsplit] warning: cannot lock {self.lock_path} ({e}); make sure no other process "
                  f"writes {self.path}", file=sys.stderr, flush=True)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {os.uname().nodename}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
