"""Where a trace replay's true output lengths come from (``workbench compare --true-output-lens``).

A request can carry a *true output length* (``true_output_len`` of
:meth:`workbench.engine.LLMEngine.add_request`): it ends there as if its model had emitted EOS, whatever
its ``max_tokens`` cap, and the contiguous baselines reserve by it (``orca-pow2``: its power of two;
``orca-oracle``: itself). vLLM has no such argument — its model decides where a request ends — but
reproducing the vLLM paper's Fig. 2 (Kwon et al., SOSP 2023) needs a cap well above long-tailed true
lengths, which a replay gets from one of these sources:

================  ==================================================================================
``model``         the model's own: a ``kv_allocator="paged"`` run first, to EOS or the cap (greedy)
``trace``         the dataset's ``output_len`` field (every record must have one)
``exponential:M`` seeded, long-tailed: exponential of mean ``M`` tokens, rounded, clipped to
                  ``[1, max_tokens]`` (ShareGPT's outputs are long-tailed; vLLM paper Fig. 11)
``auto``          ``trace`` when every record has an ``output_len``, else ``model``
================  ==================================================================================
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from workbench.bench.datasets import PromptRecord

__all__ = ["TRUE_OUTPUT_LEN_SOURCES", "exponential_output_lens", "parse_output_len_source", "true_output_lens_for"]

#: the accepted forms of ``--true-output-lens`` (``M``: a mean in tokens)
TRUE_OUTPUT_LEN_SOURCES = ("auto", "model", "trace", "exponential:M")


def exponential_output_lens(
    n: int, mean: float, seed: int = 0, min_len: int = 1, max_len: int | None = None
) -> list[int]:
    """``n`` seeded, long-tailed output lengths (tokens): ``round(Exp(mean))`` clipped to ``[min_len, max_len]``.

    The same ``(mean, seed)`` gives the same lengths (:class:`random.Random`), one draw per request in order.

    Raises:
        ValueError: ``n < 0``, ``mean <= 0`` or ``min_len`` not in ``[1, max_len]``.
    """
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    if not mean > 0:
        raise ValueError(f"mean={mean} must be > 0 tokens")
    if min_len < 1 or (max_len is not None and max_len < min_len):
        raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = max(min_len, int(round(rng.expovariate(1.0 / mean))))
        out.append(k if max_len is None else min(max_len, k))
    return out


def parse_output_len_source(spec: str) -> tuple[str, float | None]:
    """``("auto" | "model" | "trace", None)`` or ``("exponential", mean)`` from a ``--true-output-lens`` value.

    Raises:
        ValueError: another value, or a mean that is not a positive number; naming the accepted forms.
    """
    name, _, arg = str(spec).partition(":")
    if name in ("auto", "model", "trace") and not arg:
        return name, None
    if name == "exponential":
        try:
            mean = float(arg)
        except ValueError:
            mean = 0.0
        if mean > 0:
            return name, mean
    raise ValueError(
        f"true output lengths {spec!r}: use one of {', '.join(TRUE_OUTPUT_LEN_SOURCES)} (M: a mean in tokens > 0, "
        "e.g. exponential:64)"
    )


def true_output_lens_for(
    records: Sequence[PromptRecord], source: str | Sequence[int], max_tokens: int, seed: int = 0
) -> list[int] | None:
    """The true output length of each record from ``source`` (a spec of :data:`TRUE_OUTPUT_LEN_SOURCES`, or
    the lengths themselves), or ``None`` where the model's own are to be measured (``model``; ``auto``
    without every ``output_len``).

    Raises:
        ValueError: a bad spec, ``trace`` with records lacking ``output_len``, or a list of another length.
    """
    if not isinstance(source, str):
        lens = list(source)
        if len(lens) != len(records):
            raise ValueError(f"{len(lens)} true output lengths for {len(records)} prompts; give one per prompt")
        return lens
    name, mean = parse_output_len_source(source)
    traced = all(r.output_len for r in records)
    if name == "trace" and not traced:
        missing = next(r.id for r in records if not r.output_len)
        raise ValueError(
            f"true output lengths 'trace': prompt {missing!r} has no output_len field; use a dataset that records "
            "them, 'model' (a paged run measures them) or 'exponential:M'"
        )
    if name == "trace" or (name == "auto" and traced):
        return [r.output_len for r in records]
    if name == "exponential":
        return exponential_output_lens(len(records), mean, seed=seed, max_len=max_tokens)
    return None
