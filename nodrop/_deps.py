"""The `train` extra (`pip install 'nodrop[train]'`): the packages only the trainer imports.

The core package (the ops, the MoE block, the models, `nodrop.load` of an export, `nodrop info`
and `nodrop demo`) imports none of them; `nodrop train`, `compare`, `export`, `generate` and
`eval` check for them all first. pyproject.toml's `train` extra names the same distributions.
"""

from __future__ import annotations

import importlib.util

# distribution -> the module the trainer imports from it.
TRAIN_EXTRA = {
    "orbax-checkpoint": "orbax.checkpoint",
    "tensorboard": "tensorboard",
    "tqdm": "tqdm",
    "matplotlib": "matplotlib",
}
INSTALL_TRAIN = "pip install 'nodrop[train]'"


def missing_train_packages() -> list[str]:
    """The train extra's distributions whose module is not installed. Looks the modules up
    without importing them, so a broken installed package still fails where it is imported."""
    missing = []
    for distribution, module in TRAIN_EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a dotted name whose parent package is absent
            found = False
        if not found:
            missing.append(distribution)
    return missing
