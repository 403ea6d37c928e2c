"""One spool directory, one open publisher: an exclusive ``flock`` on a lock file holding the pid.

``flock`` (not ``fcntl``/``lockf`` record locks) because its locks belong to the open file, not to
the process: a second publisher opened on the same directory *in the same process* is refused
too, and the lock goes away with the process however it dies (even SIGKILL), so a crash never
leaves a stale lock behind. The pid in the file is only there to name the holder in the error.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from reliable_amqp._core.errors import ConfigurationError, SpoolError

LOCK_NAME = "spool.lock"


class DirectoryLock:
    """An exclusive lock on a spool directory, held from :meth:`acquire` until :meth:`release`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self, purpose: str = "a publisher") -> None:
        """Take the lock or raise :class:`ConfigurationError` naming the process that holds it.

        ``purpose`` says, in the error, what wanted the spool.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SpoolError(
                f"cannot open the spool lock file {self.path}: {exc.strerror or exc}"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise SpoolError(f"cannot lock {self.path}: {exc.strerror or exc}") from exc
            holder = holder_pid(self.directory)
            who = f"process {holder}" if holder is not None else "another process"
            raise ConfigurationError(
                f"the spool {self.directory} is in use by {who} (lock file {self.path}): one "
                f"spool serves one open publisher at a time; close that one before opening "
                f"{purpose} on it, or give this one a spool of its own"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise SpoolError(f"cannot write the spool lock file {self.path}: {exc}") from exc
        self._fd = fd

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Give the lock up (closing the file releases it); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)


def holder_pid(directory: str) -> int | None:
    """The pid written in the directory's lock file (None when there is none to read)."""
    try:
        with open(os.path.join(directory, LOCK_NAME), "rb") as f:
            text = f.read(32).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def in_use_by(directory: str) -> int | None:
    """The pid of the process holding the directory's lock, or None when it is free.

    Takes the lock for an instant to find out (a free lock is released at once), so a spool
    that looks in use is in use.
    """
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return holder_pid(directory) or -1
    finally:
        os.close(fd)  # releases the lock if it was taken
    return None
