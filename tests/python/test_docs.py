"""The README and docs/ stay a front door: short, and every path they give exists in this repository.

- README.md has at most README_MAX_LINES lines.
- README.md and docs/*.md name no path outside the repository: no link whose target leaves the
  repository root (`../` too far), and no `/work...` or `../shared` path anywhere in the text.
- Every relative link resolves to a file or folder of the repository (http(s) and mailto links,
  and pure `#anchor` links, are not checked).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 170

# [text](target) and ![alt](target), with an optional "title"; reference definitions [x]: target.
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# Paths of the machine the project was written on, which nobody who clones it has.
_OUTSIDE = re.compile(r"(?<![\w.])(/work\b[^\s`)\]]*|(?:\.\./)+shared\b[^\s`)\]]*)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def link_targets(text: str) -> list[str]:
    """Link targets outside code blocks and inline code."""
    prose = _INLINE_CODE.sub("", _FENCE.sub("", text))
    return _INLINE_LINK.findall(prose) + _REFERENCE_LINK.findall(prose)


def problems(text: str, where: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the markdown `text` of the file `where` inside `root`."""
    root = root.resolve()
    found = [f"names {m.group(1)!r}, a path outside the repository"
             for m in _OUTSIDE.finditer(text)]
    for target in link_targets(text):
        if re.match(r"^(https?:|mailto:|#)", target):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        if path.startswith("/"):
            found.append(f"links {target!r}: an absolute path, outside the repository")
            continue
        resolved = (where.parent / path).resolve()
        if resolved != root and root not in resolved.parents:
            found.append(f"links {target!r}, outside the repository")
        elif not resolved.exists():
            found.append(f"links {target!r}, which does not exist")
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move detail to docs/")


def test_docs_exist():
    for name in ("design.md", "performance.md", "training.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_stay_inside_the_repository(path):
    assert problems(path.read_text(), path) == []


def test_the_check_can_fail(tmp_path):
    """The checker flags each kind of bad path (so the tests above can fail)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    readme, doc = tmp_path / "README.md", tmp_path / "docs" / "design.md"
    readme.write_text("")
    doc.write_text("")
    assert problems("See [design](docs/design.md) and [bench](bench/).", readme, tmp_path) == []
    assert problems("[up](../README.md) and [bench](../bench)", doc, tmp_path) == []
    assert problems("```\n[x](../shared/DESIGN.md)\n```", readme, tmp_path) != []  # named
    assert len(problems("See [it](../shared/DESIGN.md).", readme, tmp_path)) == 2
    assert problems("See [it](../../elsewhere.md).", doc, tmp_path) != []
    assert problems("Built in /work/main/build.", readme, tmp_path) != []
    assert problems("[gone](docs/missing.md)", readme, tmp_path) != []
    assert problems("![plot](bench/nothing.png)", readme, tmp_path) != []
    assert problems("[abs](/etc/passwd)", readme, tmp_path) != []
    assert problems("[web](https://example.com/x) [anchor](#using-it)", readme, tmp_path) == []
