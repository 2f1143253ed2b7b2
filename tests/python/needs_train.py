"""Imported first by a test module of the trainer: skips that whole module, with the reason, where
the `train` extra is not installed (`pip install 'nodrop[train]'`), before its imports of the
trainer fail. With the extra installed it does nothing."""

import pytest
from conftest import TRAIN_MISSING, WITHOUT_TRAIN

if TRAIN_MISSING:
    pytest.skip(WITHOUT_TRAIN, allow_module_level=True)
