"""Whether JAX should run on an NVIDIA GPU here, and the CUDA plugin wheels that let it.

jaxlib alone runs on the CPU; JAX reaches an NVIDIA GPU through its CUDA plugin
(`jax-cuda13-plugin[with-cuda]` and `jax-cuda13-pjrt`, the same version as jaxlib). The choice:
the environment variable NODROP_JAX_CUDA when it is set (1: install the plugin, 0: do not, auto:
decide), else the plugin where `nvidia-smi -L` lists a GPU whose driver runs CUDA 13 (>= 580).

scripts/setup.sh runs this file as a script before nodrop is installed (standard library only):

    python nodrop/_gpu.py pyproject.toml   # prints: cuda|cpu, the reason, the wheels to install

and `nodrop info` uses `choose` to explain a GPU that JAX is not using.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

ENV = "NODROP_JAX_CUDA"
MIN_DRIVER = 580  # CUDA 13's minimum Linux driver (580.65)


@dataclasses.dataclass(frozen=True)
class Choice:
    cuda: bool  # install (or expect) JAX's CUDA plugin
    reason: str  # what decided it, for the set-up's output


def cuda_plugin(jaxlib_version: str) -> list[str]:
    """The pip requirements of JAX's CUDA 13 plugin for this jaxlib (with NVIDIA's CUDA wheels)."""
    return [f"jax-cuda13-plugin[with-cuda]=={jaxlib_version}",
            f"jax-cuda13-pjrt=={jaxlib_version}"]


def _run(command: list[str]) -> tuple[int, str]:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return 124, "timed out after 60 s"
    except OSError as error:
        return 127, str(error)
    return result.returncode, (result.stdout + result.stderr).strip()


def choose(environ: Mapping[str, str] = os.environ) -> Choice:
    """The choice for this machine. ValueError for an unknown NODROP_JAX_CUDA value."""
    value = environ.get(ENV, "").strip()
    if value.lower() in ("1", "yes", "cuda"):
        return Choice(True, f"{ENV}={value}")
    if value.lower() in ("0", "no", "cpu"):
        return Choice(False, f"{ENV}={value}")
    if value.lower() not in ("", "auto"):
        raise ValueError(f"{ENV} must be 1 (install JAX's CUDA plugin), 0 (do not) or auto "
                         f"(install it where nvidia-smi lists a GPU), got {value!r}")
    override = f"; {ENV}=1 installs JAX's CUDA plugin anyway"
    nvidia_smi = shutil.which("nvidia-smi", path=environ.get("PATH", os.defpath))
    if nvidia_smi is None:
        return Choice(False, f"no nvidia-smi on the PATH{override}")
    status, listing = _run([nvidia_smi, "-L"])
    gpus = re.findall(r"^GPU \d+: (.+?)(?: \(UUID: [^)]*\))?$", listing, re.MULTILINE)
    if status != 0:
        first = listing.splitlines()[0] if listing else "no output"
        return Choice(False, f"nvidia-smi -L failed (exit {status}: {first}){override}")
    if not gpus:
        return Choice(False, f"nvidia-smi lists no GPU{override}")
    status, drivers = _run([nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"])
    driver = drivers.splitlines()[0].strip() if status == 0 and drivers else ""
    found = f"nvidia-smi lists {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({gpus[0]})"
    if not re.match(r"^\d+(\.\d+)*$", driver):
        return Choice(False, f"{found} but reports no driver version ({driver or status})"
                             f"{override}")
    if int(driver.split(".")[0]) < MIN_DRIVER:
        return Choice(False, f"{found} but its driver {driver} is older than {MIN_DRIVER}, "
                             f"which JAX's CUDA 13 plugin needs{override}")
    return Choice(True, f"{found}, driver {driver}")


def main(argv: list[str]) -> int:
    """`python nodrop/_gpu.py PYPROJECT`: three lines, `cuda` or `cpu`, the reason, and the
    plugin's pip requirements (pinned to PYPROJECT's jaxlib; empty for cpu)."""
    import tomllib

    with open(argv[1], "rb") as file:
        dependencies = tomllib.load(file)["project"]["dependencies"]
    pins = [d.split("==")[1] for d in dependencies if re.match(r"^jaxlib\s*==", d)]
    if len(pins) != 1:
        print(f"{argv[1]}: expected one exact jaxlib pin, found {pins}", file=sys.stderr)
        return 2
    try:
        choice = choose()
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print("cuda" if choice.cuda else "cpu")
    print(choice.reason)
    print(" ".join(cuda_plugin(pins[0].strip())) if choice.cuda else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
