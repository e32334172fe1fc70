"""Exercises of the stage-5 chapters (production practice), registered in
:data:`workbench.labs.exercise_registry.EXERCISES`: chapter 15 (the case study), 16 (load testing),
17 (monitoring and alerting) and 18 (a performance regression baseline)."""

from __future__ import annotations

from workbench.labs.exercise_registry import _number, _register  # noqa: F401


# ---------------------------------------------------------------- chapter 15: the case study
# (chapter 15's exercises go here)


# ---------------------------------------------------------------- chapter 16: load testing
# (chapter 16's exercises go here)


# ---------------------------------------------------------------- chapter 17: monitoring and alerting
# (chapter 17's exercises go here)


# ---------------------------------------------------------------- chapter 18: a performance regression baseline
# (chapter 18's exercises go here)
