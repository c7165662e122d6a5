"""kvpilot: observability and auto-tuning for LLM inference serving."""

__version__ = "0.1.0"
