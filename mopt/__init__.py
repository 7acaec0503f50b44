"""mopt: make for model optimization."""

__version__ = "0.1.0"
