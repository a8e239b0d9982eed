"""Rendering: tables, plots and the HTML report (the only layer that renders)."""
