"""The benchmark programs of bench/: they import without side effects, share one definition of
shapes and group sizes, and the GPU benchmark's code paths run end to end on the CPU at a tiny
shape (the real shapes need an H200)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_train

BENCH = Path(__file__).resolve().parents[2] / "bench"
PROGRAMS = ("batch_invariance", "cpu_grouped_matmul", "ep_scaling", "gpu_fp8", "gpu_moe",
            "gpu_gemm_sustained", "gpu_profile", "gemm_tiles_table", "ncu_stall_regions")
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"


@pytest.fixture(scope="module", autouse=True)
def bench_on_path():
    """As `python bench/NAME.py` does: the program's folder first on sys.path."""
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("name", [pytest.param(name, marks=needs_train)
                                  if name == "batch_invariance" else name  # the trainer's
                                  for name in PROGRAMS])
def test_programs_import_without_touching_xla_settings(name, monkeypatch):
    monkeypatch.delenv(MEM_FRACTION, raising=False)
    module = importlib.import_module(name)
    assert callable(module.main)
    assert MEM_FRACTION not in os.environ


@pytest.mark.parametrize("kind", ("uniform", "zipf"))
@pytest.mark.parametrize("rows, groups", [(4096, 8), (131072, 128), (10, 3), (5, 8)])
def test_group_sizes_sum_to_the_rows(kind, rows, groups):
    import shapes

    sizes = shapes.group_sizes(kind, rows, groups)
    assert sizes.dtype == np.int32 and sizes.shape == (groups,) and sizes.sum() == rows
    assert (sizes >= 0).all()
    if kind == "zipf" and rows >= 4096:
        assert (np.diff(sizes[1:]) <= 0).all() and sizes[0] > sizes[1]


@pytest.mark.parametrize("program", ("gpu_fp8", "gpu_moe"))
def test_shapes_are_named_in_any_case_and_unknown_ones_refused(program, capsys):
    module = importlib.import_module(program)
    args = module.parse_args(["--out", "x", "--shapes", "mixtral-8x7b, QWEN3-30B-A3B"])
    assert args.shapes == ["Mixtral-8x7B", "Qwen3-30B-A3B"]
    with pytest.raises(SystemExit):
        module.parse_args(["--out", "x", "--shapes", "Mixtral-8x7B,Mixtral-8x22B"])
    assert "unknown shape Mixtral-8x22B; known: Mixtral-8x7B" in capsys.readouterr().err


def test_one_definition_of_the_shapes():
    import cpu_grouped_matmul
    import gpu_moe
    import shapes

    assert (cpu_grouped_matmul.M, cpu_grouped_matmul.K, cpu_grouped_matmul.N,
            cpu_grouped_matmul.GROUPS) == shapes.CPU_GEMM_SHAPE
    assert gpu_moe.GEMM_SHAPES is shapes.GEMM_SHAPES
    assert gpu_moe.LAYER_SHAPES is shapes.LAYER_SHAPES
    config = shapes.layer_config("Qwen3-30B-A3B", capacity_factor=1.0)
    assert (config.hidden, config.ffn, config.num_experts, config.k) == (2048, 768, 128, 8)
    assert config.capacity_factor == 1.0


def test_cpu_benchmark_writes_beside_itself_whatever_the_working_folder(tmp_path, monkeypatch):
    """Run from another folder, the default --out is bench/results of the program's checkout,
    never a bench/results made under the working folder; --out DIR is taken as given."""
    import argparse

    import cpu_grouped_matmul as cpu
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    cpu.add_arguments(parser)
    assert parser.parse_args([]).out == BENCH.resolve() / "results"
    assert parser.parse_args(["--out", "mine"]).out.absolute() == tmp_path / "mine"


def test_cpu_benchmark_summary_and_verdicts():
    import cpu_grouped_matmul as cpu

    cases = [dict(dtype="float32", group_sizes="zipf", passes="forward", matmul=name,
                  gflops=gflops, check=1e-7)
             for name, gflops in (("nodrop", 60.0), ("ragged_dot", 10.0), ("dense", 100.0))]
    row, = cpu.summarize(cases)
    assert row["nodrop_vs_dense"] == pytest.approx(0.6)
    assert row["check_ok"] and row["vs_dense_pass"] and row["vs_ragged_dot_pass"]


TINY_GEMM = (96, 16, 24, 4)  # (M, K, N, G)
TINY_LAYER = (48, 16, 24, 4, 2)  # (T, H, F, E, k)
NO_TOKAMAX = "tokamax (an optional peer of bench/gpu_moe.py) is not installed"


@pytest.fixture
def tiny_shapes(monkeypatch):
    """The GPU benchmark's shapes plus "tiny", for the CPU; no heat-up."""
    import shapes
    import timing

    monkeypatch.setitem(shapes.GEMM_SHAPES, "tiny", TINY_GEMM)
    monkeypatch.setitem(shapes.LAYER_SHAPES, "tiny", TINY_LAYER)
    monkeypatch.setattr(timing, "HEAT_S", 0.0)


@needs_train  # its plot: matplotlib
def test_gpu_moe_runs_end_to_end_at_a_tiny_shape(tmp_path, monkeypatch, tiny_shapes):
    """bench/gpu_moe.py's grouped-matmul and MoE-layer cases (MoEBlock dropless, on tokamax and
    with capacity factors), the layer's memory, summaries, tables and plot, on the CPU without
    torch; tokamax's cases run where it is installed, else are recorded as failed."""
    import gpu_moe

    monkeypatch.setattr(gpu_moe, "load_torch", lambda: (None, "not on this machine"))
    monkeypatch.setenv(MEM_FRACTION, "restored after the test")
    code = gpu_moe.main(["--out", str(tmp_path), "--shapes", "tiny", "--iters", "1"])
    assert code in (0, 1)  # 1: a speed target missed on the CPU
    assert os.environ[MEM_FRACTION] == "0.5"  # set in main(), not at import
    assert {p.name for p in tmp_path.iterdir()} == {"gpu-moe.json", "gpu-moe.md", "gpu-moe.png"}
    results = json.loads((tmp_path / "gpu-moe.json").read_text())
    layer = {case["impl"]: case for case in results["layer"]["cases"]}
    assert set(layer) == {"nodrop", "fp8_tensorwise", "fp8_blockwise", "tokamax", "capacity_1.0",
                          "capacity_1.25"}
    assert all(case["status"] == "ok" for impl, case in layer.items() if impl != "tokamax")
    assert 0 <= layer["capacity_1.0"]["dropped"] < 1 and "dropped" not in layer["nodrop"]
    for impl in ("nodrop", "fp8_tensorwise", "fp8_blockwise", "capacity_1.0", "capacity_1.25"):
        memory = layer[impl]["memory"]
        assert memory["temp_bytes_per_token"] == memory["temp_bytes"] / TINY_LAYER[0] > 0
    summary, = results["layer"]["summary"]
    assert summary["memory_saving"] > 0 and summary["speedups"]["capacity_1.0"] > 0
    assert set(summary["fp8_speedups"]) == {"tensorwise", "blockwise"}
    assert all(speedup > 0 for speedup in summary["fp8_speedups"].values())
    gemm = results["gemm"]["summary"]
    forward_rows = [row for row in gemm if row["passes"] == "forward"]
    assert {row["targets"]["check"]["verdict"] for row in forward_rows} == {"PASS"}
    # issue 19's targets: the forward against torch too, the layer against capacity 1.0 by
    # 1.10x and against the layer on tokamax
    assert all(set(row["targets"]) == {"check", "torch"} for row in forward_rows)
    assert {row["targets"]["torch"]["verdict"] for row in forward_rows} == {
        "n/a (torch._grouped_mm not run)"}
    assert summary["targets"]["capacity_1.0"]["minimum"] == 1.10
    assert summary["targets"]["tokamax"]["minimum"] == 1.0
    markdown = (tmp_path / "gpu-moe.md").read_text()
    assert "## MoE expert layer, activation memory" in markdown and " B/token " in markdown
    assert "| nodrop ms / FP8 tensorwise ms | nodrop ms / FP8 blockwise ms |" in markdown
    targets = markdown.split("## Targets")[1]
    assert "temporary bytes / nodrop temporary bytes" in targets
    assert "layer tiny: tokamax.ragged_dot ms / nodrop ms >= 1x" in targets

    tokamax_cases = [*(c for c in results["gemm"]["cases"] if c["impl"] == "tokamax"),
                     layer["tokamax"]]
    assert len(tokamax_cases) == 5  # uniform and Zipf, forward and forward+backward; the layer
    if results["tokamax"].startswith("tokamax does not import"):
        assert all(c["status"] == "error" and results["tokamax"] in c["detail"]
                   for c in tokamax_cases)
        return
    assert results["tokamax"].endswith("implementation='xla'")  # the CPU's
    assert all(c["status"] == "ok" for c in tokamax_cases), tokamax_cases
    assert all(row["tokamax_check"] <= 1e-2 for row in forward_rows)
    assert summary["speedups"]["tokamax"] > 0 and layer["tokamax"]["memory"]["temp_bytes"] > 0


def test_gpu_moe_layer_with_the_split_router(tmp_path, monkeypatch, tiny_shapes):
    """--router-matmul sets every layer variant's router and is recorded with the results."""
    import gpu_moe

    monkeypatch.setattr(gpu_moe, "load_torch", lambda: (None, "not on this machine"))
    monkeypatch.setenv(MEM_FRACTION, "restored after the test")
    seen = []
    block = gpu_moe.MoEBlock

    def recording_block(config, **kwargs):
        seen.append(config.router_matmul)
        return block(config, **kwargs)

    monkeypatch.setattr(gpu_moe, "MoEBlock", recording_block)
    code = gpu_moe.main(["--out", str(tmp_path), "--shapes", "tiny", "--iters", "1",
                         "--only", "layer", "--router-matmul", "split"])
    assert code in (0, 1)
    assert seen and set(seen) == {"split"}
    results = json.loads((tmp_path / "gpu-moe.json").read_text())
    assert results["router_matmul"] == "split"
    assert all(case["status"] == "ok" for case in results["layer"]["cases"]
               if case["impl"] != "tokamax")
    assert "MoEConfig(router_matmul='split')" in (tmp_path / "gpu-moe.md").read_text()


def test_tokamax_agrees_with_nodrop_at_a_tiny_shape(tiny_shapes):
    """tokamax.ragged_dot as bench/gpu_moe.py calls it (on the CPU, its XLA implementation)
    against nodrop.ragged_dot: the same output and gradients. And the MoE block with its expert
    matmuls on it against the dropless block: the same loss and gradients."""
    pytest.importorskip("tokamax", reason=NO_TOKAMAX)
    import jax
    import jax.numpy as jnp
    import shapes
    import tokamax_peer
    from flax import nnx
    from timing import forward_backward

    import nodrop
    from nodrop import demo
    from nodrop.moe import MoEBlock
    from nodrop.moe.block import OPS

    tokamax, status = tokamax_peer.load_tokamax()
    assert status.endswith("implementation='xla'"), status
    rows, k, n, groups = TINY_GEMM
    keys = jax.random.split(jax.random.key(0), 3)
    operands = (jax.random.normal(keys[0], (rows, k), jnp.bfloat16),
                jax.random.normal(keys[1], (groups, k, n), jnp.bfloat16),
                jnp.asarray(shapes.group_sizes("zipf", rows, groups)),
                jax.random.normal(keys[2], (rows, n), jnp.bfloat16))
    expected, actual = (jax.jit(forward_backward(matmul))(*operands)
                        for matmul in (nodrop.ragged_dot, tokamax))
    assert_close(actual, expected)

    with tokamax_peer.tokamax_ops(tokamax):
        configs = (shapes.layer_config("tiny"),
                   shapes.layer_config("tiny", ops=tokamax_peer.MOE_OPS))
        params = nnx.state(MoEBlock(configs[0], rngs=nnx.Rngs(0)), nnx.Param)
        x, target = demo.inputs(jax.random.key(1), configs[0], TINY_LAYER[0])
        expected, actual = (
            jax.jit(demo.loss_and_grads(MoEBlock(config, rngs=nnx.Rngs(0))))(params, x, target)
            for config in configs)
    assert_close(actual, expected)
    assert tokamax_peer.MOE_OPS not in OPS  # the block's op table as it was


def assert_close(actual, expected):
    """Every leaf of `actual` of the dtype of `expected`'s and within 1% (of its largest)."""
    import jax
    from nodrop.demo import relative_difference

    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype and relative_difference(got, want) < 1e-2


def test_a_missing_tokamax_is_recorded_not_raised(monkeypatch, tiny_shapes):
    """Without tokamax bench/gpu_moe.py imports, and its tokamax cases are recorded as failed,
    with the reason, while the others still run."""
    import importlib

    import gpu_moe
    import tokamax_peer

    monkeypatch.setitem(sys.modules, "tokamax", None)  # `import tokamax` raises
    importlib.reload(tokamax_peer)
    importlib.reload(gpu_moe)
    tokamax, status = tokamax_peer.load_tokamax()
    assert status.startswith("tokamax does not import: ModuleNotFoundError")
    cases = [*gpu_moe.gemm_cases_of("tiny", TINY_GEMM, 1, None, tokamax),
             *gpu_moe.layer_cases("tiny", 1, tokamax)]
    statuses = {(c["section"], c["group_sizes"], c["passes"], c["impl"]): c["status"]
                for c in cases}
    failed = {key for key, value in statuses.items() if value != "ok"}
    assert {key[3] for key in failed} == {"tokamax"} and len(failed) == 5
    assert all(status in c["detail"] for c in cases if c["impl"] == "tokamax")


@needs_train  # its plot: matplotlib
def test_gpu_fp8_dry_run_on_the_cpu(tmp_path, monkeypatch):
    """bench/gpu_fp8.py --dry-run: nodrop's two FP8 GEMMs and forward (on the CPU engine) checked
    against their dequantised operands and timed, uniform and Zipf; torch's cases n/a with the
    reason (no GPU here); tables and plot."""
    import gpu_fp8
    import timing

    monkeypatch.setattr(timing, "HEAT_S", 0.0)
    monkeypatch.setenv(MEM_FRACTION, "restored after the test")
    assert gpu_fp8.main(["--out", str(tmp_path), "--dry-run", "--iters", "1"]) == 0
    written = {p.name for p in tmp_path.iterdir()}
    assert written == {"gpu-fp8.json", "gpu-fp8.md", "gpu-fp8.png"}
    results = json.loads((tmp_path / "gpu-fp8.json").read_text())
    cases = results["cases"]
    assert [(c["group_sizes"], c["impl"]) for c in cases] == [
        (kind, impl) for kind in ("uniform", "zipf") for impl in gpu_fp8.IMPL_LABELS]
    for case in cases:
        if case["impl"].startswith("nodrop"):
            assert case["status"] == "ok" and np.isfinite(case["tflops"]) and case["tflops"] > 0
            assert case["check"] <= gpu_fp8.CHECK_TOLERANCE, case
            assert 0 < case["error_vs_bf16"] < 0.1  # E4M3's rounding, not a broken layout
        else:
            assert case["status"] == "n/a" and case["detail"] == results["torch"]
    assert [row["sizes"] for row in results["summary"]] == [[64] * 4, [125, 61, 40, 30]]
    markdown = (tmp_path / "gpu-fp8.md").read_text()
    assert "## Accuracy" in markdown and "6 of 6 pass" in markdown


def test_gpu_fp8_targets_take_the_faster_checked_torch():
    """The vs-torch target compares each of nodrop's GEMMs with the faster torch variant whose
    output passed its check; DeepGEMM's shapes have the TFLOP/s target instead; group sizes
    rounded for --row-multiple keep their sum."""
    import gpu_fp8

    def case(shape, impl, tflops, check=1e-3):
        return dict(shape=shape, dims=[1, 1, 1, 1], group_sizes="uniform", impl=impl,
                    status="ok", ms=1.0, tflops=tflops, check=check, error_vs_bf16=0.03,
                    detail="")

    mixtral, deepgemm = "Mixtral-8x7B", "DeepGEMM-N7168-K2048"
    cases = [case(mixtral, "nodrop_gemm", 900.0), case(mixtral, "nodrop_tensorwise", 800.0),
             case(mixtral, "nodrop_forward", 700.0), case(mixtral, "torch", 850.0),
             case(mixtral, "torch_fast_accum", 950.0, check=0.5),
             case(deepgemm, "nodrop_gemm", 1250.0), case(deepgemm, "nodrop_tensorwise", 1300.0),
             case(deepgemm, "nodrop_forward", 1000.0), case(deepgemm, "torch", 1300.0),
             case(deepgemm, "torch_fast_accum", 1400.0)]
    rows = gpu_fp8.summary(cases)
    first, second = rows
    assert first["torch_best"] == "torch"  # the fast-accum variant failed its check
    assert first["ratios"]["nodrop_gemm"] == pytest.approx(900 / 850)
    assert first["targets"]["vs torch nodrop_gemm"]["verdict"] == "PASS"
    assert first["targets"]["vs torch nodrop_tensorwise"]["verdict"] == "FAIL"  # 800 < 850
    assert second["torch_best"] == "torch_fast_accum"
    assert not any(name.startswith("vs torch") for name in second["targets"])
    assert second["targets"]["TFLOP/s nodrop_gemm"]["verdict"] == "PASS"
    assert second["targets"]["TFLOP/s nodrop_tensorwise"]["verdict"] == "PASS"
    failed = [line for line in gpu_fp8.target_lines(rows) if "FAIL" in line]
    assert failed == ["Mixtral-8x7B uniform: nodrop tensorwise FP8 GEMM / "
                      "torch._scaled_grouped_mm (use_fast_accum=False) >= 1x: 0.94x FAIL"]
    sizes = gpu_fp8.rounded_sizes(np.array([125, 61, 40, 30]), 16)
    assert sizes.tolist() == [160, 48, 32, 16]


def test_ncu_stall_regions(tmp_path, monkeypatch, capsys):
    import ncu_stall_regions

    csv = tmp_path / "sass.csv"
    csv.write_text('"Kernel"\n'
                   '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
                   '"7f0000000010","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24","90","512"\n'
                   '"7f0000000410","@P0 BAR.SYNC 0x1, 0x100","10","64"\n'
                   '"7f0000000420","NOP","0","64"\n')
    monkeypatch.setattr(sys, "argv", ["ncu_stall_regions.py", str(csv)])
    assert ncu_stall_regions.main() == 0
    assert capsys.readouterr().out.splitlines() == [
        "100 samples; regions with at least 0.3% of them:",
        "  +00000   90.0%  executed up to     512  HGMMA",
        "  +00400   10.0%  executed up to      64  BAR",
    ]


@needs_train
def test_a_profiled_run_traces_its_steps_and_names_the_regions(tmp_path):
    """`nodrop train --profile` traces the steps it names, timed apart from the others, and
    saves the step's HLO, whose op names put the ops in the model's named scopes (what
    gpu_profile.py's `runs` sums the GPU kernels by)."""
    import gpu_profile
    from nodrop.train import trainer
    from nodrop.train.metrics import read_jsonl

    run_dir = tmp_path / "run"
    trainer.run({"steps": 6, "batch_size": 2, "seq_len": 32, "eval_every": 6, "eval_batches": 1,
                 "checkpoint_every": 0, "log_every": 4, "profile": "3:4",
                 "model_overrides": {"num_layers": 2, "first_dense": 1, "dense_ffn": 64}},
                out=run_dir, progress=False)
    traces = list((run_dir / "tensorboard" / "plugins" / "profile").iterdir())
    assert len(traces) == 1
    assert (traces[0] / "perfetto_trace.json.gz").is_file()
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r for r in records if r["kind"] == "profile"] == [
        {"kind": "profile", "step": 4, "first_step": 3}]
    intervals = [(r["first_step"], r["step"]) for r in records if r["kind"] == "timing"]
    assert intervals == [(1, 2), (3, 4), (5, 6)]

    op_names = gpu_profile.hlo_op_names((traces[0] / "train_step.hlo.txt").read_text())
    regions = {gpu_profile.region(name) for name in op_names.values()}
    assert set(gpu_profile.SCOPES) - {"shared_experts"} <= regions
    assert gpu_profile.region("jit(train_step)/transpose(jvp(moe))/router/dot_general") == "router"
    assert gpu_profile.region("jit(train_step)/jvp()/rsqrt") is None
    assert gpu_profile.kernel_class("loop_multiply_fusion") == "XLA elementwise fusions"


@needs_train
def test_ep_scaling_dry_run_on_8_host_devices(tmp_path):
    """bench/ep_scaling.py, the expert-parallel measurement of a multi-GPU host, end to end on 8
    host CPU devices at the tiny preset (its own process: JAX takes the device count at start):
    every section reports, nothing is dropped under skew, and EP matches one device."""
    out = tmp_path / "ep"
    done = subprocess.run([sys.executable, str(BENCH / "ep_scaling.py"), "--out", str(out),
                           "--dry-run"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    results = json.loads((out / "ep-scaling.json").read_text())
    assert results["header"]["devices"] == 8
    runs = results["scaling"]["tiny"]["runs"]
    assert list(runs) == ["1 device", "EP=1", "EP=2", "EP=4", "EP=8"]
    assert all(run["status"] == "ok" and run["dropped_fraction"] == 0 for run in runs.values())
    assert results["exchange"]["tiny"]["ms"]["nodrop"] > 0
    skew = results["skew"]["tiny"]
    assert skew["verdict"] == "PASS" and set(skew["cases"]) == {
        "uniform", "zipf", "every_token_to_rank_0"}
    # The adversarial routing overflows the default buffer: it grows, and still drops nothing.
    assert skew["cases"]["every_token_to_rank_0"]["reruns"] >= 1
    assert results["match"]["tiny"]["verdict"] == "PASS"
    assert (out / "ep-scaling.png").stat().st_size > 0 and "## Skew" in (
        out / "ep-scaling.md").read_text()
