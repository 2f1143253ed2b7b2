"""What a run ran on, for config.json's "environment" record: the nodrop checkout's git commit,
the command line, the library versions, Python, the CPU and the accelerator, the start time.

A record of the run, not a setting: `--config` and `--resume` read config.json's "train" record
only, so a run started again on another machine or commit is not refused for it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path


import nodrop

# The distributions whose versions change what a run computes or writes.
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "tokenizers")


def git_commit(path: str | os.PathLike | None = None) -> str | None:
    """The commit checked out where nodrop's source lives (None outside a git checkout, or
    without git), with "-dirty" appended where tracked files differ from it."""
    where = Path(path) if path is not None else Path(nodrop.__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(where), *args], capture_output=True,
                                  text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if dirty else "")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def record(devices: list, argv: list[str] | None = None,
           started: datetime.datetime | None = None) -> dict:
    """config.json's "environment": `devices` are those the run uses."""
    started = started or datetime.datetime.now(datetime.timezone.utc)
    device = devices[0]
    return {
        "git_commit": git_commit(),
        "argv": list(sys.argv if argv is None else argv),
        "start_time": started.isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "nodrop": nodrop.__version__,
        **{name.replace("-checkpoint", ""): _version(name) for name in LIBRARIES},
        "cpu": cpu_model(),
        "host": platform.node(),
        "platform": device.platform,
        "device": device.device_kind,
        "accelerator": None if device.platform == "cpu" else device.device_kind,
        "devices": len(devices),
    }
