"""Concordia: fault tolerance for the GPU state of long-running LLM inference."""

__version__ = "0.1.0"
