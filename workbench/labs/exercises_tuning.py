"""Exercises of chapters 7 and 8 (the parameter matrix; chunked prefill), registered in :data:`workbench.labs.exercises.EXERCISES`."""

from __future__ import annotations

from workbench.labs.exercises import _register  # noqa: F401
