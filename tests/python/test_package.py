"""The package as the README's set-up leaves it: an editable install whose Python files are the
repository's own, found from the repository root by `python -m nodrop`, `import nodrop` and
pytest alike, with the built engine libraries beside them in site-packages."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_python(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_python_m_nodrop_info_runs_from_the_repository_root():
    result = run_python("-m", "nodrop", "info")
    assert result.returncode == 0, result.stderr
    assert "backends: cpu yes" in result.stdout


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


def test_public_ops_and_the_block_have_type_hints():
    """Every parameter and the return of the public ops, MoEBlock and MoEConfig are annotated,
    and the annotations resolve (typing.get_type_hints evaluates them)."""
    import dataclasses
    import inspect
    import typing

    import nodrop
    from nodrop.moe import MoEBlock, MoEConfig

    functions = [nodrop.grouped_matmul, nodrop.grouped_matmul_contract, nodrop.ragged_dot,
                 nodrop.permute, nodrop.unpermute, nodrop.topk_router, nodrop.checks,
                 MoEBlock.__init__, MoEBlock.__call__]
    for fn in functions:
        hints = typing.get_type_hints(fn)
        params = [name for name in inspect.signature(fn).parameters
                  if name != "self"]
        missing = [name for name in [*params, "return"] if name not in hints]
        assert not missing, f"{fn.__qualname__}: no type hint for {missing}"
    config_hints = typing.get_type_hints(MoEConfig)
    assert {field.name for field in dataclasses.fields(MoEConfig)} <= set(config_hints)
