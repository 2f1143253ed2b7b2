"""Models on nodrop's MoE block: a decoder-only MoE language model and its presets."""

from nodrop.models.config import PRESETS, ModelConfig, preset
from nodrop.models.lm import KVCache, ModelAux, MoELM, cast_compute_weights

__all__ = ["KVCache", "ModelAux", "ModelConfig", "MoELM", "PRESETS", "cast_compute_weights",
           "preset"]
