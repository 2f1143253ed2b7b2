"""Training on several processes (one per host, or one per GPU): `jax.distributed` joins them
into one JAX runtime whose `jax.devices()` are every process's devices, and the run's mesh spans
them all.

Where a process finds its place, first match wins:
- the flags --coordinator HOST:PORT, --num-processes N, --process-id I;
- else the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
- else, under SLURM (srun with more than one task) or Open MPI (mpirun -n N, N > 1), what
  `jax.distributed.initialize()` detects by itself;
- else one process: nothing is initialised.

Errors are ConfigError (`nodrop train: error: ...`, exit status 2) naming the flag. What
several processes share, the trainer does with the helpers here: process 0 owns the run folder
(`is_primary`), a decision one process made reaches the others (`agree`, `broadcast_error`),
and every process waits for the others at `barrier`. They are XLA collectives over the mesh's
devices (jax.experimental.multihost_utils), so each one is a point every process must reach.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading

import jax
import numpy as np

ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID"}
FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes",
         "process_id": "--process-id"}
DEFAULT_TIMEOUT_S = 300  # jax.distributed's default
# The longest message `broadcast_error` carries (bytes of UTF-8).
_MESSAGE_BYTES = 4096


def _config_error(message: str) -> Exception:
    from nodrop.train.config import ConfigError  # nodrop.train imports this module
    return ConfigError(message)


@dataclasses.dataclass(frozen=True)
class Settings:
    """How this process joins the others. coordinator, num_processes and process_id are None
    where JAX detects them (SLURM, Open MPI)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    timeout_s: int
    source: str  # "flags", "environment", "slurm" or "openmpi": for the messages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `nodrop train` that start it on several processes."""
    group = parser.add_argument_group(
        "several processes", "one process per host or per GPU, joined by jax.distributed "
        "(default: the JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID "
        "environment variables, else SLURM's or Open MPI's, else one process)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0, which the others connect to")
    group.add_argument("--num-processes", type=_int_flag("--num-processes"), metavar="N",
                       help="how many processes take part")
    group.add_argument("--process-id", type=_int_flag("--process-id"), metavar="I",
                       help="this process's index, 0 to N - 1 (0 writes the run folder)")
    group.add_argument("--init-timeout", type=_int_flag("--init-timeout"), metavar="SECONDS",
                       default=DEFAULT_TIMEOUT_S,
                       help="how long to wait for every process to connect to the coordinator "
                            f"(default {DEFAULT_TIMEOUT_S})")


def _int_flag(flag: str):
    def parse(text: str) -> int:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    parse.__name__ = flag  # what argparse names in "invalid ... value"
    return parse


def settings(args: argparse.Namespace | None = None,
             environ: dict | os._Environ = os.environ) -> Settings | None:
    """How this process joins the others, from the flags in `args`, else `environ`; None for
    a single process. ConfigError, naming the flag or variable, for an inconsistent set."""
    given = {key: getattr(args, key, None) for key in FLAGS} if args is not None else {}
    timeout = getattr(args, "init_timeout", DEFAULT_TIMEOUT_S) if args is not None \
        else DEFAULT_TIMEOUT_S
    if timeout is None:
        timeout = DEFAULT_TIMEOUT_S
    if timeout < 1:
        raise _config_error(f"--init-timeout must be a positive number of seconds, got {timeout}")
    if any(value is not None for value in given.values()):
        values, names, source = given, FLAGS, "flags"
    elif any(environ.get(name) for name in ENV.values()):
        values, names, source = {}, ENV, "environment"
        for key, name in ENV.items():
            text = environ.get(name) or None
            if text is not None and key != "coordinator":
                try:
                    text = int(text)
                except ValueError:
                    raise _config_error(f"{name} must be an integer, got {text!r}") from None
            values[key] = text
    else:
        detected = _detected(environ)
        if detected is None:
            return None
        return Settings(None, None, None, timeout, detected)
    coordinator, count, index = (values.get(key) for key in FLAGS)
    if count is not None and count < 1:
        raise _config_error(f"{names['num_processes']} must be at least 1, got {count}")
    if count == 1 and index in (None, 0):
        return None  # one process: nothing to join
    if count is None:
        raise _config_error(f"{names['num_processes']} is missing: give how many processes "
                            f"take part (with {names['process_id']} and {names['coordinator']})")
    if index is None:
        raise _config_error(f"{names['process_id']} is missing: give this process's index, "
                            f"0 to {count - 1}")
    if not 0 <= index < count:
        raise _config_error(f"{names['process_id']} must be 0 to {count - 1} "
                            f"({names['num_processes']} {count}), got {index}")
    if not coordinator:
        raise _config_error(f"{names['coordinator']} is missing: give HOST:PORT of process 0 "
                            f"(for {count} processes)")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _config_error(f"{names['coordinator']} must be HOST:PORT, got {coordinator!r}")
    return Settings(coordinator, count, index, timeout, source)


def _detected(environ) -> str | None:
    """'slurm' or 'openmpi' where one launched several tasks (JAX reads the rest itself)."""
    if "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ and _count(
            environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")) > 1:
        return "slurm"
    if _count(environ.get("OMPI_COMM_WORLD_SIZE")) > 1 and "OMPI_MCA_orte_hnp_uri" in environ:
        return "openmpi"
    return None


def _count(text) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return 0


def initialize(how: Settings, *, prog: str = "nodrop train") -> None:
    """jax.distributed.initialize, before anything starts a JAX backend. Where the processes do
    not all connect within how.timeout_s, the process prints `prog: error: ...` naming the
    flags and exits with status 2 (XLA's client would abort it a little later, with a stack
    trace, for it cannot be made to raise); ConfigError for an error JAX raises."""
    if jax.distributed.is_initialized():
        return
    joined = threading.Event()

    def give_up():
        if not joined.wait(how.timeout_s):
            print(f"{prog}: error: {_join_failure(how)}", file=sys.stderr, flush=True)
            os._exit(2)  # nothing is written yet; the client's thread would abort the process

    threading.Thread(target=give_up, name="nodrop-join-timeout", daemon=True).start()
    try:
        jax.distributed.initialize(coordinator_address=how.coordinator,
                                   num_processes=how.num_processes, process_id=how.process_id,
                                   # Past ours, so that give_up says why first.
                                   initialization_timeout=how.timeout_s + 60)
    except Exception as error:  # noqa: BLE001 - XlaRuntimeError, RuntimeError, ValueError
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise _config_error(f"{_join_failure(how)} ({type(error).__name__}: {first})") from None
    finally:
        joined.set()


def _join_failure(how: Settings) -> str:
    if how.source == "flags":
        where = (f"--coordinator {how.coordinator} (--num-processes {how.num_processes}, "
                 f"--process-id {how.process_id})")
    elif how.source == "environment":
        where = (f"JAX_COORDINATOR_ADDRESS={how.coordinator} (JAX_NUM_PROCESSES="
                 f"{how.num_processes}, JAX_PROCESS_ID={how.process_id})")
    else:
        where = f"the coordinator {how.source} describes"
    return (f"the processes did not all join through {where} within --init-timeout "
            f"{how.timeout_s}s: is process 0 running and reachable there, do all processes give "
            f"the same --num-processes, and does each give its own --process-id?")


def initialize_from_args(args: argparse.Namespace) -> None:
    """`nodrop train`'s start: joins the other processes where the flags or the environment
    say there are any."""
    how = settings(args)
    if how is not None:
        initialize(how)


def process_count() -> int:
    return jax.process_count()


def is_primary() -> bool:
    """Process 0: the one that writes the run folder, the logs and the plots."""
    return jax.process_index() == 0


def describe() -> str:
    """'2 processes x 2 devices' (for messages); '' for one process."""
    if jax.process_count() == 1:
        return ""
    return f"{jax.process_count()} processes x {jax.local_device_count()} devices"


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def agree(flag: bool) -> bool:
    """True on every process where it is true on any: a decision all must take together (to
    stop and save, for one). One process: `flag` itself."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.array([flag], dtype=np.int32))
    return bool(np.asarray(flags).any())


def broadcast_error(message: str | None) -> str | None:
    """Process 0's `message` (None: no error) on every process: what process 0 found wrong
    with the run folder reaches those waiting for it, so that all stop with the same error."""
    if jax.process_count() == 1:
        return message
    from jax.experimental import multihost_utils
    data = np.zeros(_MESSAGE_BYTES + 1, dtype=np.uint8)
    if message is not None and is_primary():
        encoded = message.encode()[:_MESSAGE_BYTES]
        data[0] = 1
        data[1:1 + len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    data = np.asarray(multihost_utils.broadcast_one_to_all(data))
    if not data[0]:
        return None
    return bytes(data[1:]).rstrip(b"\0").decode(errors="replace")


def gather(tree):
    """The global values of a pytree of jax.Arrays as numpy arrays on this process, whether or
    not its devices hold all of them (the same on every process; each must call it)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)
