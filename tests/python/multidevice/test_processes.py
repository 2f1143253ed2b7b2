"""`nodrop train` on two processes of localhost (jax.distributed, CPU collectives over Gloo),
each with 2 host devices, on a mesh that spans both: the losses of one process with 4 devices
and of one device, a checkpoint saved by one process restored by two (and the reverse), a signal
to process 0 alone stopping both at the same step, and inconsistent process flags, an
unreachable coordinator, a run folder process 0 cannot use and a mesh that does not use every
process's devices refused naming the flag. The two-process run that matches the others is
started by scripts/ep_run.sh from the JAX_* variables; the rest by the flags. Every process is
a subprocess with a timeout, so a hang fails the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import devices  # noqa: F401  (first: 8 host devices, for the in-process reference)
import needs_train  # noqa: F401  (skips this module without nodrop[train])
from runs import assert_states_close, losses, records, restored_state
import numpy as np
import pytest

from nodrop import cli
from nodrop.parallel import distributed
from nodrop.train import data, trainer
from nodrop.train.config import ConfigError, overrides_from_args

MESH = "data=2,expert=2"
STEPS = 6
TIMEOUT_S = 300
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes((data.stdlib_root() / "argparse.py").read_bytes()[:60_000])
    return path


def flags(text_file: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return ["--preset", "tiny", "--data", str(text_file), "--steps", str(steps),
            "--batch-size", "8", "--seq-len", "32", "--eval-every", "3", "--eval-batches", "2",
            "--checkpoint-every", "3", "--log-every", "3", "--no-progress", *extra]


def train(run_dir: Path, argv: list[str]) -> None:
    """`nodrop train argv` in this process, on one device."""
    args = cli.build_parser().parse_args(["train", *argv, "--out", str(run_dir)])
    trainer.run(overrides_from_args(args), out=run_dir, progress=False, echo=lambda *_: None)










def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(tmp_path_factory):
    """One persistent compilation cache for the module's processes: a run of the same shapes
    and mesh as an earlier one loads its steps rather than compiling them."""
    global CACHE
    CACHE = tmp_path_factory.mktemp("jax-cache")
    yield
    CACHE = None


CACHE: Path | None = None


def environment(devices_per_process: int) -> dict:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("JAX_", "SLURM_", "OMPI_"))}
    if CACHE is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(CACHE),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.update(JAX_NUM_CPU_DEVICES=str(devices_per_process), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    return env


def start(argv: list[str], devices_per_process: int, log: Path,
          env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nodrop", "train", *argv],
                            env={**environment(devices_per_process), **(env or {})}, cwd=REPO,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def start_script(argv: list[str], devices_per_process: int, log: Path,
                 env: dict) -> subprocess.Popen:
    """scripts/ep_run.sh, its GPUs per host played by host devices."""
    return subprocess.Popen(
        ["bash", str(REPO / "scripts" / "ep_run.sh"), *argv],
        env={**environment(devices_per_process), **env, "GPUS": str(devices_per_process),
             "NODROP": f"{sys.executable} -m nodrop"},
        cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen], logs: list[Path]) -> list[int]:
    """The exit codes; every process is killed once TIMEOUT_S have passed since the call."""
    deadline = time.monotonic() + TIMEOUT_S
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 1)))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        pytest.fail("timed out:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    return codes


def two_processes(argv: list[str], run_dir: Path, *, expect: int = 0, devices: int = 2,
                  during=None, script: bool = False) -> list[str]:
    """Runs `nodrop train argv` on two processes of `devices` each, placed by the flags (or,
    with `script`, by scripts/ep_run.sh and the JAX_* variables); their outputs."""
    port = free_port()
    logs = [run_dir.parent / f"{run_dir.name}.process{i}.log" for i in range(2)]
    if script:
        procs = [start_script([*argv, "--out", str(run_dir)], devices, logs[i], {
            "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(i)}) for i in range(2)]
    else:
        procs = [start([*argv, "--out", str(run_dir), "--coordinator", f"localhost:{port}",
                        "--num-processes", "2", "--process-id", str(i)], devices, logs[i])
                 for i in range(2)]
    if during is not None:
        during(procs)
    codes = finish(procs, logs)
    outputs = [log.read_text() for log in logs]
    assert codes == [expect] * 2, "\n".join(outputs)
    return outputs


def last_line(output: str) -> str:
    """The last line of a process's output but Gloo's notes (its connections, on stdout)."""
    return [line for line in output.strip().splitlines() if not line.startswith("[Gloo]")][-1]


def one_process(argv: list[str], run_dir: Path, devices: int) -> str:
    log = run_dir.parent / f"{run_dir.name}.log"
    codes = finish([start([*argv, "--out", str(run_dir)], devices, log)], [log])
    assert codes == [0], log.read_text()
    return log.read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_file):
    root = tmp_path_factory.mktemp("runs")
    made = {}

    def get(name: str) -> Path:
        if name in made:
            return made[name]
        run_dir = root / name
        if name == "one device":  # in this process
            train(run_dir, flags(text_file))
        elif name == "one process":
            one_process(flags(text_file, "--mesh", MESH), run_dir, devices=4)
        elif name == "two processes":  # its mesh: data=<processes>,expert=<devices of one>
            two_processes(flags(text_file), run_dir, script=True)
        elif name == "one process, resumed on two":
            shutil.copytree(get("one process"), run_dir)
            two_processes(["--resume-from", "3", "--no-progress"], run_dir)
        made[name] = run_dir
        return run_dir

    return get


def test_two_processes_reach_the_losses_of_one_process_and_one_device(runs):
    two = runs("two processes")
    # Each step logged once: process 1 wrote nothing into the folder.
    assert [r["step"] for r in records(two, "train")] == list(range(1, STEPS + 1))
    for other, rtol in ((runs("one process"), 1e-6), (runs("one device"), 2e-5)):
        np.testing.assert_allclose(losses(two), losses(other), rtol=rtol)
        np.testing.assert_allclose([r["val_loss"] for r in records(two, "eval")],
                                   [r["val_loss"] for r in records(other, "eval")], rtol=rtol)
    assert trainer.run_config(two)[0].mesh == MESH
    assert not (two / ".nodrop.lock").read_text()  # released
    # The checkpoint the two processes saved together restores whole, onto one device.
    assert_states_close(restored_state(two, STEPS), restored_state(runs("one device"), STEPS),
                        rtol=1e-4)


def test_a_checkpoint_of_one_process_resumes_on_two(runs):
    """Step 3 of a one-process run, restored by two processes (each reading its shards), goes
    on with the numbers the uninterrupted run had."""
    resumed, whole = runs("one process, resumed on two"), runs("one process")
    assert [r["step"] for r in records(resumed, "train")] == list(range(1, STEPS + 1))
    np.testing.assert_allclose(losses(resumed), losses(whole), rtol=1e-6)
    assert_states_close(restored_state(resumed, STEPS), restored_state(whole, STEPS), rtol=1e-5)


def test_a_signal_to_process_0_stops_both_at_one_step(tmp_path, text_file):
    """SIGTERM to process 0 alone: both stop at the next logged step, save it together and
    exit 143; the checkpoint is that step's."""
    run_dir = tmp_path / "stopped"

    def interrupt(procs):
        deadline = time.monotonic() + TIMEOUT_S
        while not records(run_dir, "train"):  # the loop runs
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        procs[0].send_signal(signal.SIGTERM)

    outputs = two_processes(flags(text_file, "--mesh", MESH, steps=300), run_dir, expect=143,
                            during=interrupt)
    stopped = records(run_dir, "train")[-1]["step"]
    assert stopped < 300 and stopped % 3 == 0
    assert f"interrupted (SIGTERM) at step {stopped}; saved a checkpoint there" in outputs[0]
    assert (f"interrupted (a signal to another process) at step {stopped}; saved a checkpoint "
            "there") in outputs[1]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit())[-1] == stopped


@pytest.mark.parametrize(("given", "message"), [
    (dict(num_processes=2, process_id=2, coordinator="localhost:1234"),
     "--process-id must be 0 to 1 (--num-processes 2), got 2"),
    (dict(num_processes=2, process_id=0), "--coordinator is missing: give HOST:PORT of process "
                                          "0 (for 2 processes)"),
    (dict(num_processes=2, coordinator="localhost:1234"), "--process-id is missing"),
    (dict(process_id=1, coordinator="localhost:1234"), "--num-processes is missing"),
    (dict(num_processes=0, process_id=0), "--num-processes must be at least 1, got 0"),
    (dict(num_processes=2, process_id=1, coordinator="localhost"),
     "--coordinator must be HOST:PORT, got 'localhost'"),
])
def test_inconsistent_process_flags_are_refused(given, message):
    import argparse
    args = argparse.Namespace(**{"coordinator": None, "num_processes": None, "process_id": None,
                                 "init_timeout": 300, **given})
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        distributed.settings(args, environ={})


def test_the_environment_and_slurm_are_read():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.settings(None, env) == distributed.Settings("h:1", 4, 3, 300,
                                                                   "environment")
    with pytest.raises(ConfigError, match="^JAX_PROCESS_ID must be 0 to 3 "):
        distributed.settings(None, {**env, "JAX_PROCESS_ID": "4"})
    with pytest.raises(ConfigError, match="^JAX_NUM_PROCESSES must be an integer, got 'x'"):
        distributed.settings(None, {**env, "JAX_NUM_PROCESSES": "x"})
    slurm = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert distributed.settings(None, slurm).source == "slurm"
    assert distributed.settings(None, {**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed.settings(None, {}) is None


def test_an_unreachable_coordinator_times_out_naming_the_flag(tmp_path, text_file):
    port = free_port()  # nothing listens there
    log = tmp_path / "alone.log"
    proc = start([*flags(text_file, "--mesh", MESH), "--out", str(tmp_path / "never"),
                  "--coordinator", f"localhost:{port}", "--num-processes", "2",
                  "--process-id", "1", "--init-timeout", "3"], 2, log)
    assert finish([proc], [log]) == [2], log.read_text()
    last = last_line(log.read_text())
    assert last.startswith(f"nodrop train: error: the processes did not all join through "
                           f"--coordinator localhost:{port} (--num-processes 2, --process-id 1) "
                           "within --init-timeout 3s"), last
    assert not (tmp_path / "never").exists()


def test_a_run_folder_process_0_refuses_stops_both(tmp_path, text_file):
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("someone else's")
    outputs = two_processes(flags(text_file, "--mesh", MESH), run_dir, expect=2)
    error = (f"--out {run_dir} is not empty; continue the run there with --resume, or choose "
             "another folder")
    assert last_line(outputs[0]) == f"nodrop train: error: {error}", outputs[0]
    assert last_line(outputs[1]) == f"nodrop train: error: process 0: {error}", outputs[1]
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(("mesh", "message"), [
    (["--mesh", "data=2"], "--mesh must use all 4 devices, got data=2 x fsdp=1 x expert=1 = 2 "
                           "(2 processes x 2 devices)"),
    ([], "--mesh is needed on several processes (2 processes x 2 devices): give a mesh over all "
         "4 devices, e.g. --mesh data=4"),
])
def test_a_mesh_short_of_the_devices_of_all_processes_is_refused(tmp_path, text_file, mesh,
                                                                   message):
    outputs = two_processes(flags(text_file, *mesh), tmp_path / "never", expect=2)
    for output in outputs:
        assert last_line(output) == f"nodrop train: error: {message}", output
    assert not (tmp_path / "never").exists()
