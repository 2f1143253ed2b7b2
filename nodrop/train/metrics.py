"""Where the numbers go: metrics.jsonl (one JSON object a line), TensorBoard event files, and the
progress bar.

metrics.jsonl records, each with "kind" and "step":
- train (every step): loss (the optimized total), ce, aux_loss, seq_aux_loss and z_loss (means
  over the MoE layers), grad_norm, update_norm, lr; per MoE layer max_over_mean (busiest
  expert's load over the mean) and dropped_fraction.
- timing (one per log interval, at its last step; the steps run asynchronously, so the host
  times intervals, not steps): first_step, steps (in the interval), mean_step_time_s (the
  interval's time over its steps), tokens_per_s, mfu (GPU only) and elapsed_s (training time so
  far, without compile, evaluation and checkpoints).
- eval: val_loss; val_max_over_mean, per MoE layer the busiest expert's load over the mean
  counted over all the validation batches; elapsed_s.
- compile: ep_buffer_factor (what the steps were compiled for), train_step_s, eval_step_s
  (seconds to compile).
- ep_rerun: expert parallelism's receive buffer overflowed at this step (in evaluation if
  "evaluation" is true, else in its training step, which changed nothing): old_factor, and
  new_factor (null: the worst case), with which the step or evaluation was run again.
- profile: steps first_step to step were traced (--profile) into tensorboard/plugins/profile/;
  their timing is a record of its own.

On resume the records after the checkpoint's step are dropped from metrics.jsonl, and a
TensorBoard SessionLog START at the first re-run step makes TensorBoard discard the old events
from that step on, so both tell one consistent history.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

# Peak dense bf16 FLOP/s per device, by a substring of jax's device_kind (none: MFU not logged).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12}


def peak_flops(device_kind: str) -> float | None:
    """The H100 entry is the SXM part's; an H100 PCIe (756e12) gets no MFU rather than a wrong
    one."""
    if "PCIe" in device_kind:
        return None
    return next((peak for name, peak in PEAK_FLOPS.items() if name in device_kind), None)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl; a line torn by a kill is skipped."""
    records = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _finite(value):
    """JSON has no NaN or infinity: they are written as null (a diverged step's loss)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


@contextlib.contextmanager
def _writing(path: Path):
    """Names `path` in an OSError that does not name a file (those of buffered writes)."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), str(path)) from None


class MetricsLog:
    """Appends records to metrics.jsonl and the same scalars to TensorBoard.

    start_step: the step the run (re)starts after; older records beyond it are dropped.
    """

    def __init__(self, run_dir: str | os.PathLike, start_step: int):
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self._tensorboard_dir = run_dir / "tensorboard"
        # A fresh start (step 0) keeps nothing of an attempt that saved no checkpoint.
        kept = [r for r in read_jsonl(self.path) if 0 < start_step and r["step"] <= start_step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            with _writing(tmp):
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        except OSError:
            tmp.unlink(missing_ok=True)  # metrics.jsonl is as it was
            raise
        os.replace(tmp, self.path)
        self.records = kept
        self._file = open(self.path, "a")
        self._tensorboard = EventFileWriter(str(self._tensorboard_dir))
        # TensorBoard drops the events from this step on that an earlier process wrote.
        with _writing(self._tensorboard_dir):
            self._tensorboard.add_event(event_pb2.Event(
                wall_time=time.time(), step=start_step + 1,
                session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))

    def write(self, record: dict) -> None:
        record = {key: _finite(value) for key, value in record.items()}
        self.records.append(record)
        with _writing(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()  # readable as it grows (tail -f); fsync waits for sync()
        values = []
        for key, value in record.items():
            if key in ("kind", "step") or value is None:
                continue
            if isinstance(value, list):  # per MoE layer
                values += [summary_pb2.Summary.Value(tag=f"{key}/layer_{i}", simple_value=v)
                           for i, v in enumerate(value) if v is not None]
            else:
                values.append(summary_pb2.Summary.Value(tag=f"{record['kind']}/{key}",
                                                        simple_value=float(value)))
        with _writing(self._tensorboard_dir):
            self._tensorboard.add_event(event_pb2.Event(
                wall_time=time.time(), step=record["step"],
                summary=summary_pb2.Summary(value=values)))

    def sync(self) -> None:
        """Everything written so far is on disk (before a checkpoint claims this step)."""
        with _writing(self.path):
            self._file.flush()
            os.fsync(self._file.fileno())
        with _writing(self._tensorboard_dir):
            self._tensorboard.flush()

    def close(self) -> None:
        """Syncs and closes; the files are closed even where syncing fails."""
        try:
            self.sync()
        finally:
            # What failed was raised by sync; closing retries the same writes.
            with contextlib.suppress(OSError):
                self._file.close()
            with contextlib.suppress(OSError):
                self._tensorboard.close()


class Records:
    """What a process other than 0 keeps of the log (process 0 writes it): the records, in
    memory, as MetricsLog keeps them; it writes no file."""

    def __init__(self, run_dir: str | os.PathLike, start_step: int):
        self.records = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl")
                        if 0 < start_step and r["step"] <= start_step]

    def write(self, record: dict) -> None:
        self.records.append({key: _finite(value) for key, value in record.items()})

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


class Quiet:
    """The progress of a process other than 0: nothing shown."""

    def update(self, step: int, record: dict) -> None:
        pass

    def write(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """A tqdm bar (loss, tokens/s, ETA) on a terminal, else one plain line per log interval."""

    def __init__(self, total: int, initial: int, enabled: bool | None):
        self._bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stderr)
        self._total = total

    def update(self, step: int, record: dict) -> None:
        loss, rate = record.get("loss"), record.get("tokens_per_s")
        text = {"loss": "nan" if loss is None else f"{loss:.4f}",
                "tok/s": f"{rate:,.0f}" if rate else "-"}
        if self._bar is not None:
            self._bar.set_postfix(text, refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            print(f"step {step}/{self._total}  " + "  ".join(f"{k} {v}" for k, v in text.items()),
                  file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
