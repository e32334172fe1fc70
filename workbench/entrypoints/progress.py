"""The progress bars of :meth:`workbench.entrypoints.llm.LLM.generate`: finished requests, and tokens.

A bar of finished requests alone sits at 0% for minutes while the first long prompts are
prefilled in chunks (on a loaded CPU, or with a small token budget). So ``generate`` shows two
bars, one above the other:

* ``requests``: finished requests of the batch; the postfix is the last step's index, running and
  waiting requests and KV utilization (refreshed at most twice a second);
* ``tokens``: tokens the model has processed, prefill (prompt tokens computed) plus decode (one per
  running sequence per step), counted from every step's :class:`~workbench.metrics.StepStats`; the
  postfix splits them (``prefill 9,812 + decode 1,240``). Its total is what the batch will process
  at most — every prompt plus each sequence's output budget (``max_tokens``, capped by
  ``max_model_len``) — and shrinks to the truth as requests finish (a request that stops early or
  is refused gives back what it did not use), so it reaches exactly 100% at the end.

Both bars are made by the same factory (``tqdm.auto.tqdm`` or the caller's ``use_tqdm``), so a
label (:func:`labelled_tqdm`, e.g. the variant of ``workbench compare``) names both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from workbench.outputs import RequestOutput
from workbench.sampling import SamplingParams


def labelled_tqdm(label: str, factory: Callable | None = None) -> Callable:
    """A tqdm factory whose bars are named ``"<label>: <desc>"`` (``"paged / static: requests"``)."""
    if factory is None:
        from tqdm.auto import tqdm as factory

    def make(*args, **kw):
        kw["desc"] = f"{label}: {kw['desc']}" if kw.get("desc") else label
        return factory(*args, **kw)

    return make


def planned_tokens(prompt_len: int, params: SamplingParams, max_model_len: int) -> int:
    """Tokens a request makes the model process at most: its prompt, then each of its ``n``
    sequences' output budget (``max_tokens``, capped where prompt + output reach ``max_model_len``)."""
    budget = max(0, min(params.max_tokens, max_model_len - prompt_len))
    return prompt_len + params.n * budget


def processed_tokens(out: RequestOutput) -> int:
    """Tokens a finished request made the model process: its prompt, and for each sequence one
    decode step per output token after the first (which the prefill samples); none when refused."""
    if out.error:
        return 0
    return len(out.prompt_token_ids) + sum(max(0, len(c.token_ids) - 1) for c in out.outputs)


class GenerateProgress:
    """The two bars of one ``generate`` call (module docstring).

    Args:
        factory: a tqdm-like factory (``tqdm.auto.tqdm``, or :func:`labelled_tqdm`).
        planned: request id → :func:`planned_tokens`, for every request of the batch.
    """

    REFRESH_S = 0.5  # postfix refresh of the requests bar while no request finishes

    def __init__(self, factory: Callable, planned: dict[str, int]) -> None:
        self.planned = dict(planned)
        self.total = sum(self.planned.values())
        self.prefill = self.decode = self._shown = 0
        self.requests = factory(total=len(self.planned), desc="requests", unit="req")
        self.tokens = factory(total=self.total, desc="tokens  ", unit="tok", unit_scale=True)
        self._last_postfix = 0.0

    def update(self, finished: Sequence[RequestOutput], step=None) -> None:
        """After one engine step: its finished requests and its :class:`StepStats` (``None``: none recorded)."""
        for o in finished:
            self.total -= self.planned.pop(o.request_id, 0) - processed_tokens(o)
        self.requests.update(len(finished))
        if step is not None:
            self.prefill += step.num_prefill_tokens
            self.decode += step.num_decode_tokens
        done = self.prefill + self.decode
        self.tokens.total = max(self.total, done)  # recompute preemption processes prompts again
        self.tokens.set_postfix_str(f"prefill {self.prefill:,} + decode {self.decode:,}", refresh=False)
        self.tokens.update(done - self._shown)  # redraws (at most every tqdm's mininterval)
        self._shown = done
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
