"""Stratagem: explicit, serializable distribution strategies for PyTorch training."""

__version__ = "0.1.0"
