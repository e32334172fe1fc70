"""Exercises of chapters 9 and 10 (tensor parallelism; NCCL buffer tuning), registered in :data:`workbench.labs.exercises.EXERCISES`."""

from __future__ import annotations

from workbench.labs.exercises import _register  # noqa: F401
