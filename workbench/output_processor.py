"""From sampled tokens to what a caller reads: incremental detokenization, stop strings, and the
``RequestOutput`` s each request's ``output_kind`` asks for (vLLM v1's ``OutputProcessor`` and
``IncrementalDetokenizer``, ``vllm/v1/engine/``).

The engine calls :meth:`OutputProcessor.process` once per step with the sequences that received a
token. A sequence is decoded step by step only when someone reads its text before it finishes
(``DELTA`` / ``CUMULATIVE``) or a stop string must be found; otherwise its text is decoded once, when
it finishes, exactly as ``tokenizer.decode`` gives it.
"""

from __future__ import annotations

from workbench.metrics.stats import request_record
from workbench.outputs import CompletionOutput, RequestOutput
from workbench.request import Request, RequestStatus
from workbench.sampling_params import RequestOutputKind


class IncrementalDetokenizer:
    """The text of a growing list of token ids, extended by the characters each new token completes.

    Decoding ``ids[prefix:]`` against ``ids[prefix:read]`` (the window of the last few tokens)
    keeps the tokenizer's context (a leading space, a byte-level character split over two tokens)
    without decoding the whole output every step; a trailing U+FFFD (an incomplete UTF-8 sequence)
    is held back until the next token completes it. Same scheme as vLLM's
    ``detokenize_incrementally`` and transformers' ``TextStreamer``.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self.prefix = 0  # ids[prefix:read] were decoded into text already
        self.read = 0

    def update(self, ids: list[int]) -> int:
        """Decode what ``ids`` (the whole output so far) adds; return the number of new characters."""
        if self.tokenizer is None or len(ids) <= self.read:
            return 0
        dec = self.tokenizer.decode
        before = dec(ids[self.prefix : self.read], skip_special_tokens=self.skip) if self.read > self.prefix else ""
        after = dec(ids[self.prefix :], skip_special_tokens=self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return 0  # no complete character yet (or a special token that decodes to nothing)
        new = after[len(before) :]
        self.text += new
        self.prefix, self.read = self.read, len(ids)
        return len(new)


def output_kind(sp) -> RequestOutputKind:
    """A request's output kind (``None``, the engine's default, is ``FINAL_ONLY``)."""
    return sp.output_kind or RequestOutputKind.FINAL_ONLY


class _SeqState:
    """What has been decoded and sent of one sequence."""

    def __init__(self, detok: IncrementalDetokenizer | None) -> None:
        self.detok = detok
        self.stop_reason: str | int | None = None
        self.sent_tokens = 0  # tokens already returned (DELTA)
        self.sent_chars = 0  # characters already returned (DELTA)
        self.final_text: str | None = None  # the text after a stop string cut it


class OutputProcessor:
    """Per-step text, stop strings and outputs of the engine's requests.

    Args:
        tokenizer: the model's (``None``: outputs carry token ids and empty text).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _SeqState] = {}
        self.num_streaming = 0  #: sequences whose outputs go out every step (DELTA / CUMULATIVE)
        #: sequences decoded as they go (streamed, or with stop strings): with none, :meth:`stop_strings` has no work
        self.num_detokenizing = 0

    def add(self, req: Request) -> None:
        """Start tracking a sequence (the engine calls this when it queues the request)."""
        sp = req.sampling_params
        streaming = output_kind(sp) != RequestOutputKind.FINAL_ONLY
        self.num_streaming += streaming
        detok = IncrementalDetokenizer(self.tokenizer, sp.skip_special_tokens) if streaming or sp.stop else None
        self.states[req.request_id] = _SeqState(detok)
        self.num_detokenizing += detok is not None

    def stop_strings(self, stepped: list[Request], scheduler) -> list[Request]:
        """Decode the new tokens of ``stepped`` (sequences that sampled this step); finish (with
        ``scheduler.finish``, status ``"stop"``) and return the running ones whose text now contains
        a stop string."""
        hit = []
        for req in stepped:
            st = self.states.get(req.request_id)
            if st is None or st.detok is None:
                continue
            new_chars = st.detok.update(req.output_token_ids)
            sp = req.sampling_params
            if not sp.stop or not new_chars or req.num_output_tokens < sp.min_tokens:
                continue
            text = st.detok.text
            for s in sp.stop:
                i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
                if i >= 0:
                    st.final_text = text[: i + len(s)] if sp.include_stop_str_in_output else text[:i]
                    st.stop_reason = s
                    if not req.is_finished:
                        scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                        hit.append(req)
                    break
        return hit

    def make_outputs(self, groups: dict[str, list[Request]], finished: list[Request], sampled, t0: float):
        """The ``RequestOutput`` s of this step: every finished group, and (``DELTA`` / ``CUMULATIVE``)
        every group with a sequence in ``finished`` or ``sampled`` (ids that sampled). A finished
        output's ``metrics`` is its first sequence's request record (times relative to ``t0``, the
        engine's start). Forgets finished groups."""
        touched = {r.request_id for r in finished}
        if self.num_streaming:
            touched.update(sampled)
        outs = []
        parents = {}
        for rid in touched:
            req = self._find(groups, rid)
            if req is not None:
                parents[req.parent_id] = groups[req.parent_id]
        for parent, group in parents.items():
            done = all(c.is_finished for c in group)
            kind = output_kind(group[0].sampling_params)
            if not done and kind == RequestOutputKind.FINAL_ONLY:
                continue
            if kind == RequestOutputKind.DELTA:  # what changed: sequences that sampled or finished
                seqs = [c for c in group if c.request_id in touched]
            else:
                seqs = group
            completions = [self._completion(c, kind) for c in seqs]
            first = group[0]
            out = RequestOutput(parent, first.prompt, first.prompt_token_ids, completions, done, first.error)
            out.num_cached_tokens = first.num_cached_tokens
            if first.sampling_params.prompt_logprobs is not None:
                out.prompt_logprobs = list(first.prompt_logprobs or [None])
            if done:
                out.metrics = dict(vars(request_record(group[0], t0)))  # (asdict's deep copy is slow)
                for c in group:
                    if (st := self.states.pop(c.request_id, None)) is not None:
                        self.num_streaming -= kind != RequestOutputKind.FINAL_ONLY
                        self.num_detokenizing -= st.detok is not None
            outs.append(out)
        return outs

    @staticmethod
    def _find(groups: dict[str, list[Request]], rid: str) -> Request | None:
        parent = rid if rid in groups else rid.rpartition("#")[0]
        for c in groups.get(parent, ()):
            if c.request_id == rid:
                return c
        return None

    def _completion(self, req: Request, kind: RequestOutputKind) -> CompletionOutput:
        st = self.states.get(req.request_id) or _SeqState(None)
        finished = req.is_finished
        text = self._text(req, st)
        ids = req.output_token_ids
        lps = list(req.logprobs) if req.sampling_params.logprobs is not None else None
        stop_reason = st.stop_reason
        if stop_reason is None and req.status == RequestStatus.FINISHED_STOPPED and ids:
            if ids[-1] in req.sampling_params.stop_token_ids and ids[-1] != req.eos_token_id:
                stop_reason = ids[-1]
        if kind == RequestOutputKind.DELTA:
            # the characters and tokens not returned yet; while a stop string may still match, hold
            # back its length - 1 characters (they could be its beginning)
            hold = 0
            if not finished and req.sampling_params.stop and not req.sampling_params.include_stop_str_in_output:
                hold = max(len(s) for s in req.sampling_params.stop) - 1
            end = max(st.sent_chars, len(text) - hold)
            delta, st.sent_chars = text[st.sent_chars : end], end
            new_ids, st.sent_tokens = ids[st.sent_tokens :], len(ids)
            new_lps = lps[len(lps) - len(new_ids) :] if lps is not None else None
            text, ids, lps = delta, new_ids, new_lps
        cum = None
        if lps is not None:
            cum = float(sum(p[t].logprob for p, t in zip(req.logprobs, req.output_token_ids)))
        status = req.status.value if finished else None
        return CompletionOutput(req.index, text, list(ids), status, stop_reason, lps, cum)

    def _text(self, req: Request, st: _SeqState) -> str:
        """The sequence's text so far (after a stop string's cut; whole-output decode for a finished
        sequence nobody streamed)."""
        if st.final_text is not None:
            return st.final_text
        if st.detok is not None:
            if req.is_finished:  # the last token's characters, even an incomplete one
                st.detok.update(req.output_token_ids)
                return self._flush(req, st)
            return st.detok.text
        if self.tokenizer is None or not req.output_token_ids:
            return ""
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    def _flush(self, req: Request, st: _SeqState) -> str:
        """A finished sequence's text: the decoded characters plus whatever the held-back window
        decodes to (a trailing incomplete character comes out as U+FFFD, as a whole-output decode gives it)."""
        d = st.detok
        if d.read < len(req.output_token_ids):
            tail = self.tokenizer.decode(req.output_token_ids[d.prefix :], skip_special_tokens=d.skip)
            head = self.tokenizer.decode(req.output_token_ids[d.prefix : d.read], skip_special_tokens=d.skip)
            d.text += tail[len(head) :]
            d.prefix = d.read = len(req.output_token_ids)
        return d.text
