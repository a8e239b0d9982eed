"""The ``batchfit`` command line, one module per group of commands (``main`` registers them all)."""

from __future__ import annotations

from .main import app, main

__all__ = ["app", "main"]
