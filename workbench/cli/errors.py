"""How the command lines answer bad input: the library's errors become click's usage errors (a message
naming the value and the fix, exit status 1, no traceback)."""

from __future__ import annotations

import contextlib

import click


@contextlib.contextmanager
def user_errors(*also: type[BaseException], exit_code: int = 1):
    """Turn ``ValueError`` and ``FileNotFoundError`` (and the ``also`` types) raised inside the block into
    :class:`click.ClickException` with the same message (a bad argument, a missing file), which click prints
    and exits with ``exit_code``."""
    try:
        yield
    except (ValueError, FileNotFoundError, *also) as e:
        bad = click.ClickException(str(e))
        bad.exit_code = exit_code
        raise bad from None
