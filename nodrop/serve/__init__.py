"""Using a trained model: load it from a run folder or an export, export its weights, generate
text with a KV cache, evaluate its loss."""

from nodrop.serve.weights import LoadError, Loaded, export, load

__all__ = ["LoadError", "Loaded", "export", "load"]
