"""Checks shared by the frozen config dataclasses (MoEConfig, ModelConfig, TrainConfig), whose
errors name the field, what it must be, and the value it got."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def requirer(config, name_of: Callable[[str], str], error: type[Exception] = ValueError):
    """require(ok, field, expected) for `config`: unless ok, raises
    error("<name_of(field)> must be <expected>, got <the field's value>")."""
    def require(ok: bool, field: str, expected: str) -> None:
        if not ok:
            raise error(f"{name_of(field)} must be {expected}, got {getattr(config, field)!r}")
    return require


def unknown_fields(cls, fields) -> list[str]:
    """The keys of `fields` that are not fields of the dataclass `cls`, sorted."""
    return sorted(set(fields) - {field.name for field in dataclasses.fields(cls)})
