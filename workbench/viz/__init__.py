"""Visualisation helpers for workbench runs (plotly HTML reports)."""
