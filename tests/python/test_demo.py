"""`nodrop demo`: one MoE layer on nodrop's ops checked against the pure-JAX references."""

from __future__ import annotations

import re

import pytest

from nodrop import cli, demo

SMALL = ["demo", "--tokens", "48", "--hidden", "16", "--ffn", "32", "--experts", "4",
         "--topk", "2", "--iters", "1"]
NAMES = ("output", "loss", "grad x", "grad router", "grad gate_up", "grad down")


def test_demo_passes_and_reports_every_difference(capsys):
    assert cli.main(SMALL) == 0
    out = capsys.readouterr().out
    for name in NAMES:  # "  grad x       1.2e-07  ok"
        assert re.search(rf"^  {re.escape(name)} +\S+  ok$", out, re.MULTILINE), out
    assert "jax.lax.ragged_dot" in out
    assert out.rstrip().endswith("PASS")


def test_demo_fails_when_a_difference_exceeds_the_tolerance(capsys, monkeypatch):
    monkeypatch.setitem(demo.TOLERANCE, "float32", -1.0)  # every difference is too large
    assert cli.main(SMALL) == 1
    out = capsys.readouterr().out
    assert "TOO LARGE" in out
    assert out.rstrip().endswith("FAIL: nodrop differs from the references beyond the tolerance")


def test_demo_rejects_topk_above_experts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--experts", "2", "--topk", "3"])
    assert exit_info.value.code == 2
    assert "--topk (3) must be at most --experts (2)" in capsys.readouterr().err


def test_bench_is_no_longer_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench"])
    assert "invalid choice: 'bench'" in capsys.readouterr().err
