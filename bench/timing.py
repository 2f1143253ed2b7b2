"""What the benchmarks time and how: grouped-matmul passes and timing loops.

Two timing loops. `median_ms` (the CPU benchmark): the median wall time of single jitted calls,
each waited for. `side_by_side` (the GPU benchmarks): calls queued back to back as in a training
step, implementations taking turns so that each meets the card in the same state.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import statistics
import time

import jax
import numpy as np

import nodrop
from nodrop import demo


# --- grouped-matmul passes ----------------------------------------------------------------------


def forward(matmul):
    """step(lhs, rhs, group_sizes, grad_out) -> matmul(lhs, rhs, group_sizes)."""
    return lambda lhs, rhs, group_sizes, grad_out: matmul(lhs, rhs, group_sizes)


def forward_backward(matmul):
    """step(lhs, rhs, group_sizes, grad_out) -> (output, (grad lhs, grad rhs)) for the output
    gradient grad_out: 3 GEMMs."""
    def step(lhs, rhs, group_sizes, grad_out):
        out, vjp = jax.vjp(lambda lhs, rhs: matmul(lhs, rhs, group_sizes), lhs, rhs)
        return out, vjp(grad_out)
    return step


PASSES = {"forward": (forward, 1), "forward+backward": (forward_backward, 3)}  # (step, GEMMs)


# --- CPU: single calls --------------------------------------------------------------------------


def median_ms(fn, args, iters: int) -> float:
    """Median wall time of jit(fn)(*args) in milliseconds, after two untimed calls (the first
    compiles): `nodrop demo`'s loop."""
    return demo.median_ms(jax.jit(fn), args, iters)


# --- GPU: windows of calls, side by side ---------------------------------------------------------

# WARMUP calls (the first compiles), HEAT_S seconds of calls, then the median over REPEATS of the
# mean time of `iters` calls queued back to back. Every case of bench/gpu_moe.py is compute-bound
# and its operands together exceed the H200's 60 MB L2, so inputs are not rotated.
WARMUP, REPEATS, DEFAULT_ITERS = 3, 5, 10
# An H200 reaches its power limit, where a training step runs, about a second into back-to-back
# work; 5 repeats of a short step (DeepSeek-V3 EP8: 0.15 s) would otherwise time the warm-up.
HEAT_S = 1.5
CASE_BUDGET_S = 3.0  # a slow case (jax.lax.ragged_dot) gets fewer timed calls, to stay near this


def seconds_per_call(run, sync, iters: int) -> tuple[float, int]:
    """(median seconds per call, calls per repeat) of run(); sync(result) waits for the device."""
    (seconds, iters), = side_by_side({"": (run, sync)}, iters).values()
    return seconds, iters


def side_by_side(runs: dict, iters: int) -> dict:
    """{name: (median seconds per call, calls per repeat)} for runs {name: (run, sync)}.

    Calls are queued back to back and synchronized once per repeat, as in a training step, so
    host launch gaps are hidden. The runs take turns, repeat by repeat, in an order reversed
    every other repeat: an H200 at its power limit loses clock within a fraction of a second,
    so two implementations compared one after the other would meet different cards.
    """
    calls = {}
    for name, (run, sync) in runs.items():
        for _ in range(WARMUP):
            start = time.perf_counter()
            sync(run())
            call_s = time.perf_counter() - start
        calls[name] = max(1, min(iters, int(CASE_BUDGET_S / (REPEATS * call_s))))

    def window(name: str) -> float:
        """Seconds per call over one window of calls[name] calls."""
        run, sync = runs[name]
        start = time.perf_counter()
        for _ in range(calls[name]):
            result = run()
        sync(result)
        return (time.perf_counter() - start) / calls[name]

    order = list(runs)
    heat_end = time.perf_counter() + HEAT_S
    while time.perf_counter() < heat_end:  # untimed windows, in turns, up to the power limit
        for name in order:
            window(name)
    samples = {name: [] for name in runs}
    for _ in range(REPEATS):
        for name in order:
            samples[name].append(window(name))
        order.reverse()
    return {name: (statistics.median(samples[name]), calls[name]) for name in runs}


# --- what a GPU benchmark's results record about its run -----------------------------------------


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_run_metadata(torch, iters: int, **timing_extra) -> dict:
    """Date, devices, versions (and `torch`, the module or None), nodrop's engines and the
    timing loop's settings, for a GPU benchmark's JSON; each benchmark adds its own fields."""
    return dict(
        date=datetime.date.today().isoformat(),
        time=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=dict(jax=jax.devices()[0].device_kind,
                    torch=torch.cuda.get_device_name(0) if torch else None),
        versions=dict(python=platform.python_version(), jax=jax.__version__,
                      jaxlib=package_version("jaxlib"), nodrop=nodrop.__version__,
                      numpy=np.__version__, torch=torch.__version__ if torch else None),
        nodrop_engines=nodrop.backends(),
        xla_mem_fraction=os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
        timing=dict(warmup=WARMUP, heat_s=HEAT_S, repeats=REPEATS, iters=iters,
                    case_budget_s=CASE_BUDGET_S, **timing_extra))
