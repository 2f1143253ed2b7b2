"""Models on nodrop's MoE block: a decoder-only MoE language model and its presets."""

from nodrop.models.config import PRESETS, ModelConfig, preset
from nodrop.models.lm import ModelAux, MoELM

__all__ = ["ModelAux", "ModelConfig", "MoELM", "PRESETS", "preset"]
