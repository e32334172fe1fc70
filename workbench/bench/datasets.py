"""Prompt datasets for benchmarks: the project's own prompt set and a loader for prompt files.

Two file formats are accepted by :func:`load_prompts`, detected from the file's content
(not its name):

* **ShareGPT JSON**: one JSON list of ``{"id": ..., "conversations": [{"from": "human" | "gpt",
  "value": ...}, ...]}``. This is the format of ``ShareGPT_V3_unfiltered_cleaned_split.json``,
  the dataset vLLM's ``benchmarks/benchmark_serving.py`` samples its serving prompts from.
  Only the first human turn of each conversation is kept, as a chat prompt.
* **JSON Lines**: one JSON object per line with exactly one of ``"prompt"`` (a string),
  ``"messages"`` (a list of ``{"role", "content"}`` dicts) or ``"text"`` (a string), and
  optionally ``"id"``, ``"chat"``, ``"max_tokens"`` and ``"output_len"``. Other keys (such as
  ``"kind"`` in ``datasets/default_prompts.jsonl``) are ignored. Blank lines are skipped.

Nothing here tokenises: prompt lengths are measured in characters, while ``max_tokens`` and
``output_len`` are in tokens of whatever model the engine runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_PROMPTS_PATH",
    "PromptRecord",
    "default_prompts",
    "load_prompts",
    "select_prompts",
]

logger = logging.getLogger(__name__)

DEFAULT_PROMPTS_PATH = Path(__file__).resolve().parents[2] / "datasets" / "default_prompts.jsonl"
"""The project's own prompt set (JSON Lines), ``<repo>/datasets/default_prompts.jsonl``."""

_PROMPT_FIELDS = ("prompt", "messages", "text")
_HUMAN_ROLES = ("human", "user")
_ACCEPTED_FORMATS = (
    "accepted formats: a ShareGPT JSON list "
    '([{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}, ...]) '
    'or JSON Lines with one object per line holding "prompt", "messages" or "text" '
    '(e.g. {"id": "p1", "prompt": "..."})'
)


@dataclass
class PromptRecord:
    """One benchmark prompt.

    Attributes:
        prompt: plain text, or chat messages ``[{"role": ..., "content": ...}, ...]``.
        chat: True if the engine should apply the model's chat template (a plain-text
            prompt is then sent as a single user message); False to feed the text as is.
        id: identifier, unique within the file it came from.
        max_tokens: cap on generated tokens requested for this prompt, if the file gives one.
        output_len: the true output length in tokens when a trace records it, else None. A run
            replays it when every record has one (``true_output_lens`` of
            :func:`~workbench.bench.run.run_job`: the request ends there, as at EOS).
        reply: ShareGPT only: the ``"gpt"`` turn that answers the prompt, if the conversation has one
            (``workbench bench serve`` tokenises it for the output length, as vLLM's ShareGPT
            sampler does); not compared or shown.
    """

    prompt: str | list[dict[str, str]]
    chat: bool
    id: str
    max_tokens: int | None = None
    output_len: int | None = None
    reply: str | None = field(default=None, compare=False, repr=False)


def default_prompts(num_prompts: int | None = None) -> list[PromptRecord]:
    """Load the project's own prompt set from :data:`DEFAULT_PROMPTS_PATH`.

    The set mixes short questions, medium instructions and long documents to summarise
    (from a few dozen characters to about 5,500), interleaved so that the first N prompts are a
    mix too. See ``datasets/README.md`` for counts and length statistics.

    Args:
        num_prompts: keep only the first N prompts (in file order); None keeps all.

    Raises:
        FileNotFoundError: if the dataset file is missing from the checkout.
        ValueError: if the file is malformed (see :func:`load_prompts`).
    """
    return load_prompts(DEFAULT_PROMPTS_PATH, num_prompts=num_prompts)


def select_prompts(
    num_prompts: int | None,
    dataset: str | os.PathLike[str] | None = None,
    records: list[PromptRecord] | None = None,
) -> tuple[list[PromptRecord], str | None]:
    """The first ``num_prompts`` prompts of ``records``, of the ``dataset`` file, or of the project's
    own set (neither given), and a warning when there are fewer than asked for.

    A job asked for more prompts than the source holds runs all of them; it says so instead of
    silently running fewer: the warning (``"asked for 100 prompts; the dataset
    datasets/default_prompts.jsonl has 74 — running 74"``) is logged here, and returned for the
    caller to repeat where a person will see it (the run's summary on the command line).

    Returns:
        ``(records, warning)``; ``warning`` is ``None`` when ``num_prompts`` is ``None`` or met.

    Raises:
        ValueError: both ``dataset`` and ``records``; and what :func:`load_prompts` raises.
    """
    if records is not None:
        if dataset is not None:
            raise ValueError("give either dataset or records, not both")
        where = "the records given have"
        picked = list(records)[:num_prompts]
    else:
        file = Path(dataset) if dataset is not None else DEFAULT_PROMPTS_PATH
        where = f"the dataset {_shown(file)} has"
        picked = load_prompts(file, num_prompts)
    warning = None
    if num_prompts is not None and len(picked) < num_prompts:
        warning = f"asked for {num_prompts:,} prompts; {where} {len(picked):,} — running {len(picked):,}"
        logger.warning("%s", warning)
    return picked, warning


def _shown(file: Path) -> str:
    """``file`` relative to the checkout when inside it (``datasets/default_prompts.jsonl``), else as given."""
    try:
        return str(file.resolve().relative_to(DEFAULT_PROMPTS_PATH.parents[1]))
    except ValueError:
        return str(file)


def load_prompts(path: str | os.PathLike[str], num_prompts: int | None = None) -> list[PromptRecord]:
    """Load prompts from a ShareGPT JSON file or a JSON Lines file, detected by content.

    ShareGPT (the format of ``ShareGPT_V3_unfiltered_cleaned_split.json``, used by vLLM's
    ``benchmarks/benchmark_serving.py``): a JSON list of conversations. The first turn whose
    ``"from"`` is ``"human"`` (or ``"user"``) becomes the prompt, with ``chat=True``; later
    turns are dropped, except the ``"gpt"`` reply right after it, kept as ``reply`` (its length
    in tokens needs a tokenizer, which this module does not use). Conversations with no human turn or only whitespace in it are skipped and
    counted in a log warning rather than raising. The record id is the conversation's
    ``"id"``, or ``"sharegpt-<index>"`` if it has none.

    JSON Lines: one object per line with exactly one of ``"prompt"`` (non-empty string),
    ``"messages"`` (non-empty list of ``{"role": str, "content": str}``) or ``"text"``
    (non-empty string). Optional keys: ``"id"`` (string or integer; default
    ``"<file stem>:<line number>"``; must be unique in the file), ``"chat"`` (bool; default
    True, and must be True with ``"messages"``), ``"max_tokens"`` and ``"output_len"``
    (positive integers, in tokens, or null). Unknown keys are ignored; blank lines are skipped.

    Args:
        path: the file to read (UTF-8, optionally with a byte-order mark).
        num_prompts: keep only the first N usable prompts in file order (deterministic); if the
            file has fewer, all of them are returned without error. None keeps all. For JSON
            Lines, lines after the N-th prompt are not read, so they are not validated either.

    Returns:
        The prompts, in file order.

    Raises:
        FileNotFoundError: if ``path`` does not exist (the message names the path).
        TypeError: if ``num_prompts`` is not None or an int.
        ValueError: if ``num_prompts`` is negative; if the file is empty, not UTF-8, or in
            neither format (the message lists the accepted formats); or if a JSON Lines line
            is malformed (bad JSON, not an object, no prompt field, empty prompt, wrong types,
            duplicate id) or a ShareGPT entry has the wrong structure. Line errors read
            ``"<path> line <n>: <what is wrong>; <how to fix it>"`` with a 1-based line number.
    """
    if num_prompts is not None:
        if isinstance(num_prompts, bool) or not isinstance(num_prompts, int):
            raise TypeError(f"num_prompts must be None or an int, got {num_prompts!r}")
        if num_prompts < 0:
            raise ValueError(f"num_prompts must be non-negative, got {num_prompts}")
    file = Path(path)
    if not file.exists():
        raise FileNotFoundError(f"prompt file not found: {file}")
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not UTF-8 text ({exc}); save the file as UTF-8") from exc

    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"{file}: file is empty; {_ACCEPTED_FORMATS}")
    if stripped[0] == "[":
        return _load_sharegpt(file, text, num_prompts)
    if stripped[0] == "{":
        return _load_jsonl(file, text, num_prompts)
    raise ValueError(f"{file}: unrecognised prompt file format (starts with {stripped[:20]!r}); {_ACCEPTED_FORMATS}")


def _load_sharegpt(file: Path, text: str, num_prompts: int | None) -> list[PromptRecord]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{file} line {exc.lineno}: starts like a ShareGPT JSON list but is not valid JSON "
            f"({exc.msg} at column {exc.colno}); fix the JSON, or if this is meant to be JSON Lines, "
            f"put one object per line with no enclosing [ ]"
        ) from exc
    # Text starting with "[" that parses is always a list.
    records: list[PromptRecord] = []
    skipped = 0
    for index, entry in enumerate(data):
        if num_prompts is not None and len(records) >= num_prompts:
            break
        where = f"{file} entry {index + 1}"
        if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
            raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
                f'{where}: expected an object with a "conversations" list, got '
                f"{_describe(entry)}; a JSON list must be in ShareGPT format "
                '({"id": ..., "conversations": [{"from": "human", "value": "..."}]}), '
                "or write one prompt object per line as JSON Lines instead"
            )
        prompt = None
        reply = None
        turns = entry["conversations"]
        for turn_no, turn in enumerate(turns, 1):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str):
                raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
                    f'{where} turn {turn_no}: expected {{"from": str, "value": str}}, got '
                    f'{_describe(turn)}; give every turn a "from" and a "value"'
                )
            if turn["from"].lower() in _HUMAN_ROLES:
                value = turn.get("value")
                if not isinstance(value, str):
                    raise ValueError(
                        f'{where} turn {turn_no}: "value" must be a string, got {_describe(value)}; '
                        'put the human message text in "value"'
                    )
                prompt = value
                after = turns[turn_no] if turn_no < len(turns) else None
                if isinstance(after, dict) and after.get("from") == "gpt" and isinstance(after.get("value"), str):
                    reply = after["value"]
                break
        if prompt is None or not prompt.strip():
            skipped += 1
            continue
        raw_id = entry.get("id")
        rec_id = str(raw_id) if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else None
        records.append(PromptRecord(prompt=prompt, chat=True, id=rec_id or f"sharegpt-{index}", reply=reply))
    if skipped:
        logger.warning(
            "%s: skipped %d ShareGPT conversation(s) with no human turn or empty text",
            file,
            skipped,
        )
    return records


def _load_jsonl(file: Path, text: str, num_prompts: int | None) -> list[PromptRecord]:
    records: list[PromptRecord] = []
    first_line_of_id: dict[str, int] = {}
    # Split on "\n" only: str.splitlines() would also split inside prompts holding U+2028 etc.
    for lineno, line in enumerate(text.split("\n"), 1):
        if num_prompts is not None and len(records) >= num_prompts:
            break
        if not line.strip():
            continue
        where = f"{file} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if not records and _is_single_json_object(text):
                raise ValueError(
                    f"{file}: is a single JSON object spread over several lines, not JSON Lines; {_ACCEPTED_FORMATS}"
                ) from exc
            raise ValueError(
                f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one "
                'complete JSON object, e.g. {"prompt": "..."}'
            ) from exc
        if not isinstance(obj, dict):
            raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
                f'{where}: expected a JSON object, got {_describe(obj)}; write e.g. {{"prompt": "..."}}'
            )
        record = _record_from_object(obj, where, default_id=f"{file.stem}:{lineno}")
        if record.id in first_line_of_id:
            raise ValueError(
                f'{where}: duplicate id "{record.id}" (first used on line {first_line_of_id[record.id]}); '
                "give every line a unique id, or drop the ids to number lines automatically"
            )
        first_line_of_id[record.id] = lineno
        records.append(record)
    return records


def _record_from_object(obj: dict[str, Any], where: str, default_id: str) -> PromptRecord:
    present = [key for key in _PROMPT_FIELDS if key in obj]
    if not present:
        raise ValueError(
            f'{where}: missing "prompt" (expected one of "prompt", "messages", "text"); '
            'add e.g. "prompt": "..." to this line'
        )
    if len(present) > 1:
        both = " and ".join(f'"{key}"' for key in present)
        raise ValueError(f"{where}: has both {both}; keep exactly one prompt field per line")
    key = present[0]
    value = obj[key]

    chat = obj.get("chat", True)
    if chat is None:
        chat = True
    if not isinstance(chat, bool):
        raise ValueError(  # noqa: TRY004 - bad file content, not a bad argument
            f'{where}: "chat" must be true or false, got {_describe(chat)}; use a JSON boolean'
        )

    prompt: str | list[dict[str, str]]
    if key == "messages":
        prompt = _check_messages(value, where)
        if not chat:
            raise ValueError(
                f'{where}: "messages" needs "chat": true (a message list cannot be sent as plain text); '
                'remove "chat" or use "prompt" for plain text'
            )
    else:
        if not isinstance(value, str):
            raise ValueError(f'{where}: "{key}" must be a string, got {_describe(value)}; quote the prompt text')
        if not value.strip():
            raise ValueError(f'{where}: "{key}" is empty; put the prompt text in it or delete the line')
        prompt = value

    raw_id = obj.get("id")
    if raw_id is None:
        rec_id = default_id
    elif isinstance(raw_id, str) and raw_id.strip():
        rec_id = raw_id
    elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
        rec_id = str(raw_id)
    else:
        raise ValueError(
            f'{where}: "id" must be a non-empty string or an integer, got {_describe(raw_id)}; '
            'fix it or remove "id" to number the line automatically'
        )

    return PromptRecord(
        prompt=prompt,
        chat=chat,
        id=rec_id,
        max_tokens=_positive_int_or_none(obj, "max_tokens", where),
        output_len=_positive_int_or_none(obj, "output_len", where),
    )


def _check_messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(
            f'{where}: "messages" must be a non-empty list, got {_describe(value)}; '
            'write e.g. "messages": [{"role": "user", "content": "..."}]'
        )
    for i, message in enumerate(value, 1):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not message["role"].strip()
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f'{where}: message {i} must be {{"role": str, "content": str}}, got {_describe(message)}; '
                'give every message a "role" (e.g. "user") and a string "content"'
            )
    if not any(message["content"].strip() for message in value):
        raise ValueError(f'{where}: every message in "messages" is empty; put the prompt text in "content"')
    return [{"role": message["role"], "content": message["content"]} for message in value]


def _positive_int_or_none(obj: dict[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f'{where}: "{key}" must be a positive integer (tokens) or null, got {_describe(value)}; '
            f'fix it or remove "{key}"'
        )
    return value


def _is_single_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _describe(value: Any) -> str:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"{type(value).__name__} {shown}"
