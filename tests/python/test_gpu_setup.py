"""The GPU set-up, on this CPU machine: which JAX platform nodrop/_gpu.py chooses from a fake
nvidia-smi on the PATH and NODROP_JAX_CUDA, what scripts/jax-plugin.sh (run by scripts/setup.sh)
then installs (with a fake pip: nothing is downloaded), and that `nodrop info` never calls an
engine usable when JAX has no device for it."""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys
import tomllib

import pytest

import nodrop
from nodrop import _ffi, _gpu, cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
JAXLIB = next(r.split("==")[1] for r in tomllib.loads((ROOT / "pyproject.toml").read_text())
              ["project"]["dependencies"] if r.startswith("jaxlib=="))
PLUGIN = [f"jax-cuda13-plugin[with-cuda]=={JAXLIB}", f"jax-cuda13-pjrt=={JAXLIB}"]
H200 = "GPU {i}: NVIDIA H200 (UUID: GPU-5a0c6f2e-0000-4000-8000-00000000000{i})"


def fake_nvidia_smi(folder: pathlib.Path, *, gpus: int = 1, driver: str = "580.95.05",
                    fails: str | None = None) -> str:
    """A PATH holding only a fake nvidia-smi answering -L and the driver query as the real one
    does, or failing with `fails` on stderr (exit 9) as it does without a working driver."""
    folder.mkdir(exist_ok=True)
    def lines(items):
        return " ".join(shlex.quote(item) for item in items) or "''"
    listing = lines(H200.format(i=i) for i in range(gpus))
    body = (f"echo {shlex.quote(fails)} >&2; exit 9" if fails else
            f'case "$1" in -L) printf "%s\\n" {listing};; '
            f'--query-gpu=driver_version) printf "%s\\n" {lines([driver] * gpus)};; '
            f'*) exit 2;; esac')
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(folder)


@pytest.mark.parametrize("gpus, driver, fails, expected", [
    (1, "580.95.05", None, "nvidia-smi lists 1 GPU (NVIDIA H200), driver 580.95.05"),
    (8, "590.48.01", None, "nvidia-smi lists 8 GPUs (NVIDIA H200), driver 590.48.01"),
])
def test_a_listed_gpu_with_a_cuda_13_driver_gets_the_plugin(tmp_path, gpus, driver, fails,
                                                             expected):
    path = fake_nvidia_smi(tmp_path / "bin", gpus=gpus, driver=driver, fails=fails)
    assert _gpu.choose({"PATH": path}) == _gpu.Choice(True, expected)


@pytest.mark.parametrize("gpus, driver, fails, expected", [
    (0, "580.95.05", None, "nvidia-smi lists no GPU"),
    (1, "580.95.05", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
     "driver.", "nvidia-smi -L failed (exit 9: NVIDIA-SMI has failed because it couldn't "
     "communicate with the NVIDIA driver.)"),
    (1, "535.104.05", None, "nvidia-smi lists 1 GPU (NVIDIA H200) but its driver 535.104.05 is "
     "older than 580, which JAX's CUDA 13 plugin needs"),
    (1, "[N/A]", None, "nvidia-smi lists 1 GPU (NVIDIA H200) but reports no driver version "
     "([N/A])"),
])
def test_no_usable_gpu_keeps_jax_on_the_cpu(tmp_path, gpus, driver, fails, expected):
    path = fake_nvidia_smi(tmp_path / "bin", gpus=gpus, driver=driver, fails=fails)
    override = "; NODROP_JAX_CUDA=1 installs JAX's CUDA plugin anyway"
    assert _gpu.choose({"PATH": path}) == _gpu.Choice(False, expected + override)


def test_no_nvidia_smi_keeps_jax_on_the_cpu(tmp_path):
    choice = _gpu.choose({"PATH": str(tmp_path)})
    assert not choice.cuda and choice.reason.startswith("no nvidia-smi on the PATH")


def test_the_environment_variable_overrides_the_detection(tmp_path):
    gpu = fake_nvidia_smi(tmp_path / "bin")
    assert _gpu.choose({"PATH": gpu, "NODROP_JAX_CUDA": "0"}) == _gpu.Choice(
        False, "NODROP_JAX_CUDA=0")
    assert _gpu.choose({"PATH": str(tmp_path), "NODROP_JAX_CUDA": "1"}) == _gpu.Choice(
        True, "NODROP_JAX_CUDA=1")
    assert _gpu.choose({"PATH": gpu, "NODROP_JAX_CUDA": "auto"}).cuda
    with pytest.raises(ValueError, match="NODROP_JAX_CUDA must be 1 .* got 'gpu'"):
        _gpu.choose({"PATH": gpu, "NODROP_JAX_CUDA": "gpu"})


def run_jax_plugin(tmp_path: pathlib.Path, path: str, **env: str) -> tuple[
        subprocess.CompletedProcess, str | None]:
    """scripts/jax-plugin.sh on a fake virtual environment whose pip only logs its arguments;
    returns the run and what pip was asked (None: not called)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    for name, body in (("python", f'exec {sys.executable} "$@"'),
                       ("pip", f'echo "$@" >> {log}')):
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "jax-plugin.sh"), str(venv)],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PATH": f"{path}:/usr/bin:/bin", **env})
    return result, log.read_text().strip() if log.exists() else None


def test_the_set_up_installs_the_plugin_pinned_to_jaxlib_on_a_gpu_machine(tmp_path):
    result, pip = run_jax_plugin(tmp_path, fake_nvidia_smi(tmp_path / "bin"))
    assert result.returncode == 0, result.stderr
    assert ("JAX on the GPU (nvidia-smi lists 1 GPU (NVIDIA H200), driver 580.95.05): "
            f"installing its CUDA plugin {' '.join(PLUGIN)}") in result.stdout
    assert pip == f"install -q {' '.join(PLUGIN)}"


def test_the_set_up_installs_no_plugin_without_a_gpu(tmp_path):
    result, pip = run_jax_plugin(tmp_path, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "JAX on the CPU: no nvidia-smi on the PATH" in result.stdout
    assert pip is None
    result, pip = run_jax_plugin(tmp_path / "forced", str(tmp_path), NODROP_JAX_CUDA="1")
    assert "JAX on the GPU (NODROP_JAX_CUDA=1): installing its CUDA plugin" in result.stdout
    assert pip == f"install -q {' '.join(PLUGIN)}"


def test_the_set_up_stops_on_a_bad_override(tmp_path):
    result, pip = run_jax_plugin(tmp_path, str(tmp_path), NODROP_JAX_CUDA="maybe")
    assert result.returncode != 0 and pip is None
    assert "NODROP_JAX_CUDA must be 1" in result.stderr


def test_info_reports_a_built_cuda_engine_jax_cannot_use(tmp_path, monkeypatch, capsys):
    # This CPU-only jaxlib with a CUDA engine built (as on a GPU machine before its plugin is
    # installed), where nvidia-smi lists a GPU.
    monkeypatch.setattr(_ffi, "_cuda_lib", object())
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path / "bin"))
    monkeypatch.delenv("NODROP_JAX_CUDA", raising=False)
    assert nodrop.backends() == {"cpu": True, "cuda": False}
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "devices: cpu:0 (JAX runs on cpu)" in out
    assert "backends: cpu yes, cuda no (built, but JAX has no CUDA device: no CUDA plugin)" in out
    assert ("GPU: nvidia-smi lists 1 GPU (NVIDIA H200), driver 580.95.05; JAX does not use it: "
            f"install its CUDA plugin: pip install '{PLUGIN[0]}' '{PLUGIN[1]}'") in out


def test_info_on_a_cpu_machine(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_ffi, "_cuda_lib", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backends: cpu yes, cuda no (not built: the build found no nvcc or no CUTLASS)" in out
    assert "GPU:" not in out
