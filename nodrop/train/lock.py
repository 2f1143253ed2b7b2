"""An exclusive lock on a run folder, held for the run's life, so two processes never write one.

The lock is `flock` on `<run folder>/.nodrop.lock`: the kernel releases it when its process ends
in any way (kill -9 included), so a lock is never stale. The file keeps the holder's pid, host and
start time, for the error the next process prints; a file whose lock is free names a process
that ended without removing it, which is noted and taken over.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from pathlib import Path

FILE = ".nodrop.lock"


class RunFolderError(RuntimeError):
    """The run folder cannot be used: another process holds it, or it cannot be created or
    written."""


class RunLock:
    """`with RunLock(run_dir, echo):` holds the folder (created if missing), or raises
    RunFolderError naming the holder, or why the folder cannot be created or written."""

    def __init__(self, run_dir: str | os.PathLike, echo=print):
        self.path = Path(run_dir) / FILE
        self._echo = echo
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileExistsError:  # mkdir(exist_ok=True) on an existing file
            raise RunFolderError(f"cannot use --out {self.path.parent}: expected a folder (or "
                                 "a path to create one), got a file") from None
        except OSError as error:
            raise RunFolderError(f"cannot use --out {self.path.parent}: "
                                 f"{error.strerror or error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _describe(_read(fd))
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise RunFolderError(
                    f"{self.path.parent} is in use by another nodrop process ({holder}); wait "
                    "for it to end or choose another --out") from None
            raise RunFolderError(f"cannot lock --out {self.path.parent}: "
                                 f"{error.strerror or error}") from None
        previous = _read(fd)
        if previous:
            self._echo(f"nodrop: {self.path.parent} was last held by {_describe(previous)}, "
                       "which ended without releasing it; taking it over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(),
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        }).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: released cleanly
        os.close(self._fd)  # closing releases the flock
        self._fd = None


def _read(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "an unknown process"
    return (f"pid {holder['pid']} on {holder.get('host', 'an unknown host')}, since "
            f"{holder.get('since', 'an unknown time')}")
