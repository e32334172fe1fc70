"""Contexts and known wrong answers of chapter 12's exercises (``workbench/labs/ch12_your_own_allocator.py``): your own allocator."""

# 12.1: the learner's allocator class, through the conformance check (workbench.labs.ch12_your_own_allocator)
from workbench.labs.ch12_your_own_allocator import EXERCISE_CONTEXT as _EX_12_1
from workbench.labs.ch12_your_own_allocator import DoubleHandNextFit as _DoubleHand
from workbench.labs.ch12_your_own_allocator import LeakyNextFit as _Leaky

CONTEXTS: dict = {"12.1": dict(_EX_12_1)}
WRONG: dict = {"12.1": [_Leaky, _DoubleHand, "next-fit", dict]}
