"""Contexts and known wrong answers of the stage-5 chapters' exercises (chapters 15-18, production practice),
for tests/test_labs.py."""

CONTEXTS: dict = {}
WRONG: dict = {}

# ---------------------------------------------------------------- chapter 15: the case study
# (chapter 15's contexts go here)

# ---------------------------------------------------------------- chapter 16: load testing
# (chapter 16's contexts go here)

# ---------------------------------------------------------------- chapter 17: monitoring and alerting
# (chapter 17's contexts go here)

# ---------------------------------------------------------------- chapter 18: a performance regression baseline
# (chapter 18's contexts go here)
