"""The self-checking exercises of the chapter notebooks: :class:`Exercise`, :data:`EXERCISES`,
:func:`check`, :func:`solution`, solutions mode.

Each chapter's exercises live at the end of its own module (``workbench/labs/chNN_*.py``) and register
here with ``_register`` when that module is imported; :func:`check` imports the chapter's module itself
when its exercises are not registered yet, and :func:`load_all` imports every chapter's.

A learner's cell reads::

    answer = ...            # replace ... with your answer
    check("1.1", answer)

:func:`check` prints a verdict: not answered yet (with a hint), correct, or not yet (with why).
Every exercise carries its reference solution, and every call of :func:`check` first verifies
that solution against the same context (the learner's own run): if the solution does not pass,
the exercise is broken and :class:`ExerciseBroken` is raised. nbval runs every notebook in CI, so
a broken exercise cannot ship; ``tests/test_labs.py`` also checks each solution passes and known
wrong answers fail.

Solutions mode: with ``WORKBENCH_LAB_SOLUTIONS=1`` in the environment, an unanswered exercise
(``...``) is answered with its solution and checked, so an instructor can run a chapter end to
end; :func:`solution` returns the solution of one exercise for a given context.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Exercise",
    "ExerciseBroken",
    "EXERCISES",
    "Verdict",
    "chapter_module",
    "check",
    "load_all",
    "solution",
    "solutions_mode",
]


class ExerciseBroken(AssertionError):
    """An exercise's own solution fails its check (a defect of the course, not of the learner)."""


@dataclass(frozen=True)
class Exercise:
    """One exercise.

    Attributes:
        id: ``"chapter.number"``.
        question: what is asked, with the unit.
        hint: shown while unanswered.
        solution: ``solution(**context) -> answer``.
        judge: ``judge(answer, **context) -> (ok, message)``.
    """

    id: str
    question: str
    hint: str
    solution: Callable[..., Any]
    judge: Callable[..., tuple[bool, str]]


EXERCISES: dict[str, Exercise] = {}


def _register(id: str, question: str, hint: str):
    def deco(cls):
        EXERCISES[id] = Exercise(id, question, hint, cls.solution, cls.judge)
        return cls

    return deco


def solutions_mode() -> bool:
    """True when ``WORKBENCH_LAB_SOLUTIONS`` is set to 1 / true / yes."""
    return os.environ.get("WORKBENCH_LAB_SOLUTIONS", "").strip().lower() in ("1", "true", "yes")


def solution(exercise_id: str, **context: Any) -> Any:
    """The reference answer of an exercise for this context.

    Raises:
        KeyError: an unknown exercise id (the message lists the known ones).
    """
    return _get(exercise_id).solution(**context)


def chapter_module(chapter: int) -> str:
    """The dotted name of chapter ``chapter``'s module (``workbench.labs.chNN_<name>``).

    Raises:
        KeyError: no module of that chapter."""
    from pathlib import Path

    found = sorted(Path(__file__).parent.glob(f"ch{chapter:02d}_*.py"))
    if not found:
        raise KeyError(f"no chapter {chapter}")
    return f"workbench.labs.{found[0].stem}"


def load_all() -> dict[str, Exercise]:
    """Import every chapter's module (registering its exercises); :data:`EXERCISES`, in chapter order."""
    import importlib
    from pathlib import Path

    for path in sorted(Path(__file__).parent.glob("ch[0-9][0-9]_*.py")):
        importlib.import_module(f"workbench.labs.{path.stem}")
    order = sorted(EXERCISES, key=lambda e: tuple(int(p) for p in e.split(".")))  # 2.1 before 10.1
    return {k: EXERCISES[k] for k in order}


def _get(exercise_id: str) -> Exercise:
    if exercise_id not in EXERCISES:  # the chapter's module registers its exercises when imported
        import importlib

        try:
            importlib.import_module(chapter_module(int(str(exercise_id).split(".")[0])))
        except (KeyError, ValueError):
            pass
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        known = ", ".join(load_all())
        raise KeyError(f"no exercise {exercise_id!r}; known: {known}") from None


def check(exercise_id: str, answer: Any = ..., **context: Any) -> Verdict:
    """Check an answer and print a verdict; returns a :class:`Verdict` (true when correct).

    Args:
        exercise_id: e.g. ``"1.1"``.
        answer: the learner's answer; ``...`` (Ellipsis) means not answered yet.
        **context: what the exercise is about (a run's steps, a memory budget...), as the
            notebook passes it.

    Raises:
        ExerciseBroken: the exercise's own solution fails for this context.
        KeyError: an unknown exercise id.
        TypeError: missing or unexpected context (the message names what the exercise takes).
    """
    ex = _get(exercise_id)
    _check_context(ex, context)
    ref = ex.solution(**context)
    ok, why = ex.judge(ref, **context)
    if not ok:
        raise ExerciseBroken(f"exercise {exercise_id}: the reference solution fails its own check ({why})")
    if answer is ... or _is_stub(answer):  # `...`, or a function whose body is still `...`
        if not solutions_mode():
            return _unanswered(ex)
        print(f"[{exercise_id}] solutions mode: checking the reference solution")
        answer = ref
    probe = _Returns(answer) if callable(answer) else None
    try:
        ok, why = ex.judge(probe or answer, **context)
    except Exception as e:  # a learner's function that raises is a wrong answer, not a crash
        ok, why = False, f"your answer raised {type(e).__name__}: {e}"
    if not ok and probe is not None and probe.returned_none and not probe.returned_value:
        why = "your function returned None — is a `return` missing?"
    _say(f"[{exercise_id}] {'correct' if ok else 'not yet'}: {why}")
    return Verdict(ok)


class Verdict:
    """What :func:`check` returns: true when correct; shows nothing in a notebook (the verdict is printed)."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Verdict({self.ok})"

    def _ipython_display_(self) -> None:
        pass


def _unanswered(ex: Exercise) -> Verdict:
    _say(f"[{ex.id}] not answered yet: {ex.question}")
    _say(f"    hint: {ex.hint}")
    return Verdict(False)


#: Width of a verdict line: a notebook's output column at 1366 px with the file browser open holds
#: about 90 characters of monospace; longer lines would be broken inside words.
VERDICT_WIDTH = 88


def _say(text: str) -> None:
    """Print ``text`` wrapped between words at :data:`VERDICT_WIDTH`, continuation lines indented."""
    indent = " " * (len(text) - len(text.lstrip()) + 4)
    print(textwrap.fill(text, VERDICT_WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False))


class _Returns:
    """Wraps a learner's function: did it return ``None``, or something else?"""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.returned_value = False
        self.returned_none = False

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        if out is None:
            self.returned_none = True
        else:
            self.returned_value = True
        return out


def _stub():  # the body a notebook's exercise cell starts with
    ...


def _is_stub(answer: Any) -> bool:
    """True for a function whose body is only ``...`` (or ``pass``), or a class with such a method of its own
    (a skeleton whose TODOs are open): not answered yet."""
    if isinstance(answer, type):
        return any(_is_stub(v) for v in vars(answer).values() if callable(v) and not isinstance(v, type))
    code = getattr(answer, "__code__", None)
    return code is not None and code.co_code == _stub.__code__.co_code and code.co_consts[:1] in ((None,), ())


def _check_context(ex: Exercise, context: dict) -> None:
    import inspect

    params = inspect.signature(ex.solution).parameters
    missing = [n for n in params if n not in context]
    unknown = [n for n in context if n not in params]
    if missing or unknown:
        need = ", ".join(f"{n}=..." for n in params) or "no context"
        raise TypeError(
            f"exercise {ex.id} takes {need} (as in the chapter's cell)"
            + (f"; missing: {', '.join(missing)}" if missing else "")
            + (f"; unexpected: {', '.join(unknown)}" if unknown else "")
        )


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=rel)


def _number(answer: Any) -> float | None:
    if isinstance(answer, bool) or not isinstance(answer, int | float):
        return None
    return float(answer)
