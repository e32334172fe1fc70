"""The progress bars of :meth:`workbench.entrypoints.llm.LLM.generate`: finished requests, and tokens.

A bar of finished requests alone sits at 0% for minutes while the first long prompts are
prefilled in chunks (on a loaded CPU, or with a small token budget). So ``generate`` shows two
bars, one above the other:

* ``requests``: finished requests of the batch; the postfix is the last step's index, running and
  waiting requests and KV utilization (refreshed at most twice a second);
* ``tokens``: tokens the model has processed, prefill (prompt tokens computed) plus decode (one per
  running sequence per step), counted from every step's :class:`~workbench.metrics.StepStats`; the
  postfix splits them (``prefill 9,812 + decode 1,240``). Its total is what is done plus what the
  unfinished requests still need at most (:func:`remaining_tokens`): it shrinks when a request stops
  early, grows when a preempted one must recompute, drops by prefix-cache hits, and reaches exactly
  100% at the end.

Both bars are made by the same factory (``tqdm.auto.tqdm`` or the caller's ``use_tqdm``), so a
label (:func:`labelled_tqdm`, e.g. the variant of ``workbench compare``) names both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from workbench.outputs import RequestOutput


def labelled_tqdm(label: str, factory: Callable | None = None) -> Callable:
    """A tqdm factory whose bars are named ``"<label>: <desc>"`` (``"paged / static: requests"``)."""
    if factory is None:
        from tqdm.auto import tqdm as factory

    def make(*args, **kw):
        kw["desc"] = f"{label}: {kw['desc']}" if kw.get("desc") else label
        return factory(*args, **kw)

    return make


def remaining_tokens(scheduler) -> int:
    """Tokens the scheduler's unfinished requests still make the model process, at most: a request with
    ``num_computed_tokens`` of its prompt and outputs in the cache still needs the rest of them, then one
    decode step per output token it may still sample, up to its output budget (``max_tokens``, capped by
    ``max_model_len``) less one — the last sampled token is never fed back. A request preempted by
    recompute has ``num_computed_tokens = 0`` again; prefix-cache hits count as computed; parallel-sampling
    siblings not forked yet share the prompt and need only their decode steps."""
    n = 0
    for queue in (scheduler.waiting, scheduler.running, scheduler.swapped):
        for r in queue:
            n += max(0, r.num_prompt_tokens + r.max_output_tokens - 1 - r.num_computed_tokens)
    for siblings in scheduler.fork_pending.values():
        n += sum(max(0, r.max_output_tokens - 1) for r in siblings)
    return n


class GenerateProgress:
    """The two bars of one ``generate`` call (module docstring).

    Args:
        factory: a tqdm-like factory (``tqdm.auto.tqdm``, or :func:`labelled_tqdm`).
        num_requests: requests of the batch.
        remaining: tokens the unfinished requests still need (:func:`remaining_tokens` of the engine's scheduler).
    """

    REFRESH_S = 0.5  # postfix refresh of the requests bar while no request finishes

    def __init__(self, factory: Callable, num_requests: int, remaining: Callable[[], int]) -> None:
        self.remaining = remaining
        self.prefill = self.decode = 0
        self.requests = factory(total=num_requests, desc="requests", unit="req")
        self.tokens = factory(total=remaining(), desc="tokens  ", unit="tok", unit_scale=True)
        self._last_postfix = 0.0

    def update(self, finished: Sequence[RequestOutput], step=None) -> None:
        """After one engine step: its finished requests and its :class:`StepStats` (``None``: none recorded)."""
        self.requests.update(len(finished))
        done_before = self.prefill + self.decode
        if step is not None:
            self.prefill += step.num_prefill_tokens
            self.decode += step.num_decode_tokens
        done = self.prefill + self.decode
        self.tokens.total = done + self.remaining()
        self.tokens.set_postfix_str(f"prefill {self.prefill:,} + decode {self.decode:,}", refresh=False)
        self.tokens.update(done - done_before)  # redraws (at most every tqdm's mininterval)
        now = time.perf_counter()
        if step is not None and (finished or now - self._last_postfix > self.REFRESH_S):
            self._postfix(step, refresh=True)
            self._last_postfix = now

    def _postfix(self, step, refresh: bool) -> None:
        self.requests.set_postfix(
            step=step.step,
            running=step.num_running,
            waiting=step.num_waiting,
            kv=f"{step.kv_utilization:.0%}",
            refresh=refresh,
        )

    def close(self, step=None) -> None:
        """The last step's figures, both bars at their exact totals, closed."""
        if step is not None:
            self._postfix(step, refresh=False)
        done = self.prefill + self.decode
        self.tokens.total = done
        self.tokens.set_postfix_str(f"prefill {self.prefill:,} + decode {self.decode:,}", refresh=False)
        self.requests.close()  # top bar first: in a terminal both stay, in their order
        self.tokens.close()
