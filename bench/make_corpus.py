"""Copies the .py files of this Python's packages (site-packages and dist-packages) into a
folder, in sorted order, up to a size cap: a training set larger than the standard library that
needs no download (docs/quality.md).

    python3 bench/make_corpus.py OUT_DIR MIB
"""

import shutil
import site
import sys
from pathlib import Path


def main(out: Path, cap_bytes: int) -> None:
    roots = sorted(set(site.getsitepackages()))
    total = files = 0
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if path.is_symlink() or not path.is_file():
                continue
            size = path.stat().st_size
            if size == 0 or total + size > cap_bytes:
                continue
            target = out / Path(root).name / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            total += size
            files += 1
    print(f"corpus: {files} files, {total / 2**20:.1f} MiB from {len(roots)} package folders")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python3 bench/make_corpus.py OUT_DIR MIB")
    main(Path(sys.argv[1]), int(float(sys.argv[2]) * 2**20))
