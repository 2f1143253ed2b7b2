"""The package as the README's set-up leaves it: an editable install whose Python files are the
repository's own, found from the repository root by `python -m nodrop`, `import nodrop` and
pytest alike, with the built engine libraries beside them in site-packages. And as `pip install`
leaves it: its dependencies, extras and pins."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _editable() -> bool:
    """Whether nodrop is installed editable (`pip install -e`, as the README's set-up does)."""
    try:
        url = importlib.metadata.distribution("nodrop").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return False
    return bool(url and json.loads(url).get("dir_info", {}).get("editable"))


# From the repository root `import nodrop` finds the source folder: it runs where the set-up's
# editable install (or a library built into it) gives that folder its engine. A plain
# `pip install .` gives only the installed copy one.
from_the_root = pytest.mark.skipif(
    not (_editable() or any((ROOT / "nodrop").glob("libnodrop_ffi_*.so"))),
    reason="nodrop is not installed editable from this checkout (pip install ., not the set-up)")


def run_python(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@from_the_root
def test_python_m_nodrop_info_runs_from_the_repository_root():
    result = run_python("-m", "nodrop", "info")
    assert result.returncode == 0, result.stderr
    assert "backends: cpu yes" in result.stdout


@from_the_root
def test_import_from_the_repository_root_is_the_source_package():
    result = run_python("-c", "import nodrop; print(nodrop.__file__); print(nodrop.backends())")
    assert result.returncode == 0, result.stderr
    path, backends = result.stdout.splitlines()
    assert pathlib.Path(path) == ROOT / "nodrop" / "__init__.py"
    assert "'cpu': True" in backends


def test_an_unbuilt_source_tree_says_what_to_run(tmp_path):
    # A copy of the sources with no built library, imported without the editable install's
    # finder: the error must name the fix, not blame an import path.
    shutil.copytree(ROOT / "nodrop", tmp_path / "nodrop",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    code = ("import sys\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'Redirecting' not in type(f).__name__]\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\n"
            "import nodrop\n")
    result = run_python("-c", code, cwd=tmp_path)
    assert result.returncode != 0
    assert "its C++ engine is not built" in result.stderr
    assert "make setup" in result.stderr


def pyproject() -> dict:
    import tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_core_package_imports_none_of_the_trainers_packages(tmp_path):
    # What `pip install nodrop` (no train extra) must run: the ops, MoE block, models, serving,
    # and the CLI's parser (`nodrop info`, `nodrop demo`).
    code = ("import sys\n"
            "import nodrop, nodrop.models, nodrop.moe, nodrop.parallel, nodrop.serve.generate\n"
            "from nodrop import cli\n"
            "cli.build_parser()\n"
            "from nodrop._deps import TRAIN_EXTRA\n"
            "print(sorted(m for m in TRAIN_EXTRA.values() if m in sys.modules))\n")
    result = run_python("-c", code, cwd=tmp_path)  # the nodrop tests import, wherever it is
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_train_extra_is_the_one_the_cli_and_tests_check():
    import re

    from nodrop._deps import TRAIN_EXTRA
    extra = pyproject()["project"]["optional-dependencies"]["train"]
    assert sorted(re.match(r"[A-Za-z0-9_.-]+", r).group() for r in extra) == sorted(TRAIN_EXTRA)


def test_jax_and_jaxlib_are_exact_and_the_same_at_build_and_run_time():
    # The FFI handlers are compiled against the build's jaxlib headers and loaded by the runtime's.
    project = pyproject()
    runtime = [r for r in project["project"]["dependencies"] if r.startswith(("jax=", "jaxlib="))]
    build = [r for r in project["build-system"]["requires"] if r.startswith(("jax=", "jaxlib="))]
    assert sorted(runtime) == sorted(build) == ["jax==0.11.2", "jaxlib==0.11.2"]
    other = [r for r in project["project"]["dependencies"] if r not in runtime]
    assert not [r for r in other if "==" in r], "only jax and jaxlib are exact"


def test_a_training_command_without_the_train_extra_says_what_to_install(monkeypatch, capsys):
    from nodrop import _deps, cli
    monkeypatch.setitem(_deps.TRAIN_EXTRA, "nodrop-absent-package", "nodrop_absent_module")
    assert cli.main(["train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "nodrop train: error: needs the trainer's packages" in err
    assert "nodrop-absent-package): pip install 'nodrop[train]'" in err  # after any real ones


def test_the_public_api_is_typed():
    """Every parameter and the return of the public ops, MoEBlock, nodrop.serve's functions and
    nodrop.backends are annotated, and the annotations resolve (typing.get_type_hints evaluates
    them); py.typed tells type checkers to trust them."""
    import dataclasses
    import inspect
    import typing

    import nodrop
    from nodrop.moe import MoEBlock, MoEConfig
    from nodrop.serve import Loaded, export, generate, load
    assert (ROOT / "nodrop" / "py.typed").is_file()
    functions = [nodrop.grouped_matmul, nodrop.grouped_matmul_contract, nodrop.ragged_dot,
                 nodrop.fp8_grouped_matmul, nodrop.grouped_matmul_fp8_blockwise_contract,
                 nodrop.grouped_matmul_fp8_tensorwise,
                 nodrop.grouped_matmul_fp8_tensorwise_contract, nodrop.quantize, nodrop.dequantize,
                 nodrop.permute, nodrop.unpermute, nodrop.topk_router, nodrop.checks,
                 MoEBlock.__init__, MoEBlock.__call__, nodrop.backends, load, export,
                 generate.check_sampling, generate.generate, generate.evaluate, Loaded.encode,
                 Loaded.decode, Loaded.vocabulary.fget]
    for function in functions:
        hints = typing.get_type_hints(function)
        parameters = [name for name in inspect.signature(function).parameters if name != "self"]
        missing = [name for name in [*parameters, "return"] if name not in hints]
        assert not missing, f"{function.__qualname__}: no type hint for {', '.join(missing)}"
    config_hints = typing.get_type_hints(MoEConfig)
    assert {field.name for field in dataclasses.fields(MoEConfig)} <= set(config_hints)
