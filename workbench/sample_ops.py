"""The sampler's per-row operations, as vLLM's (``vllm/v1/sample/ops/penalties.py``,
``vllm/v1/sample/sampler.py``): repetition / frequency / presence penalties and ``min_tokens``,
applied to the logits before temperature, top-k and top-p; and the log-probabilities returned
with ``SamplingParams.logprobs`` / ``prompt_logprobs`` (of the raw logits, vLLM's default
``raw_logprobs``). :func:`workbench.sampling.sample` calls them only for rows that need them.
"""

from __future__ import annotations

import torch

from workbench.outputs import Logprob

#: one position's top entries, as the executor returns them: ``(token_id, logprob, rank)`` tuples
RawLogprobs = list[tuple[int, float, int]]


def needs_processing(p) -> bool:
    """Whether a row with :class:`~workbench.sampling_params.SamplingParams` ``p`` gets penalties or a
    ``min_tokens`` mask (the plain path is a batched argmax / draw without token histories)."""
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1 or p.min_tokens > 0


def process_row(row: torch.Tensor, p, req) -> torch.Tensor:
    """One row's logits after ``min_tokens`` and the penalties (a new tensor; ``row`` is left as is).

    Args:
        row: ``[vocab_size]`` float32 logits.
        p: the row's :class:`~workbench.sampling_params.SamplingParams`.
        req: the row's request: ``prompt_token_ids``, ``output_token_ids`` (token ids < vocab_size)
            and ``eos_token_id`` (``None``: no EOS).

    Returns ``[vocab_size]`` float32:

    * ``min_tokens``: while fewer than ``p.min_tokens`` tokens are out, EOS (unless ``ignore_eos``)
      and ``stop_token_ids`` get ``-inf`` (vLLM's ``MinTokensLogitsProcessor``);
    * ``repetition_penalty`` r (CTRL, Keskar et al. 2019, arXiv:1909.05858, as vLLM): a token seen in
      the prompt or the output has its logit divided by r when positive, multiplied by r otherwise;
    * ``frequency_penalty`` f and ``presence_penalty`` q (OpenAI's definition, as vLLM): a token that
      occurs c times in the output loses ``f * c + q * (c > 0)``.
    """
    row = row.clone()
    vocab = row.numel()
    out = req.output_token_ids
    if len(out) < p.min_tokens:
        banned = [t for t in p.stop_token_ids if t < vocab]
        if not p.ignore_eos and req.eos_token_id is not None:
            banned.append(req.eos_token_id)
        if banned:
            row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
    if p.repetition_penalty == 1 and p.frequency_penalty == 0 and p.presence_penalty == 0:
        return row
    counts = torch.zeros(vocab, dtype=torch.float32, device=row.device)
    if out:
        counts.index_add_(
            0, torch.tensor(out, dtype=torch.long, device=row.device), torch.ones(len(out), device=row.device)
        )
    if p.repetition_penalty != 1:
        seen = counts > 0
        seen[torch.tensor(req.prompt_token_ids, dtype=torch.long, device=row.device)] = True
        r = p.repetition_penalty
        row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
    return row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def process_rows(logits: torch.Tensor, params: list, requests: list | None) -> torch.Tensor:
    """``[rows, vocab_size]`` float32 logits with :func:`process_row` applied to the rows that need it
    (a new tensor then; ``logits`` itself when none does, or ``requests`` is ``None``)."""
    if requests is None or not any(needs_processing(p) for p in params):
        return logits
    logits = logits.clone()
    for i, (p, req) in enumerate(zip(params, requests)):
        if needs_processing(p):
            logits[i] = process_row(logits[i], p, req)
    return logits


def top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row of temperature-scaled logits ``[vocab_size]`` with the tokens outside the ``top_k`` most likely
    (``top_k <= 0``: all kept) and outside the nucleus of mass ``top_p`` set to ``-inf`` (Holtzman et al., ICLR
    2020; vLLM's order: top-k first, then top-p). The most likely token is always kept."""
    if 0 < top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p; never the most likely one (a
        # top_p that rounds to 0 in float32 would otherwise drop them all)
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
    return row


def prompt_positions(req, start: int, n: int) -> tuple[int, int] | None:
    """The prompt positions ``lo..hi-1`` among a step's ``start..start+n-1`` whose logits give a
    ``prompt_logprobs`` request entries it does not have yet (position p: prompt token p+1), or ``None``."""
    lo = max(start, len(req.prompt_logprobs or [None]) - 1)
    hi = min(start + n, len(req.prompt_token_ids) - 1)
    return (lo, hi) if hi > lo else None


def top_logprobs(logits: torch.Tensor, chosen: list[int] | None, ks: list[int]) -> list[RawLogprobs]:
    """Each row's ``ks[i]`` most likely tokens and its chosen token, with log-probabilities.

    Args:
        logits: ``[rows, vocab_size]`` raw logits (before penalties and temperature), any float dtype.
        chosen: per row the token whose entry is always included (the sampled token, or the prompt's
            next token), or ``None`` for none.
        ks: per row how many top tokens (0 to vocab_size).

    Returns:
        per row a list of ``(token_id, logprob, rank)``: the chosen token first (when given), then the
        top ``k`` by rank (1 = most likely); logprob is ``log_softmax`` (natural log) in float32; a
        chosen token's rank counts the tokens strictly more likely, plus one.
    """
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    kmax = max(ks)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax > 0 else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    rows: list[RawLogprobs] = [[] for _ in ks]
    if chosen is not None:
        idx = torch.tensor(chosen, dtype=torch.long, device=lp.device)[:, None]
        c_lp = lp.gather(1, idx)
        ranks = ((lp > c_lp).sum(-1) + 1).tolist()
        for i, (t, v, r) in enumerate(zip(chosen, c_lp[:, 0].tolist(), ranks)):
            rows[i].append((t, v, r))
    for i, k in enumerate(ks):
        rows[i] += [(t, v, j + 1) for j, (t, v) in enumerate(zip(top_i[i][:k], top_v[i][:k]))]
    return rows


def to_position(raw: RawLogprobs, tokenizer) -> dict[int, Logprob]:
    """``token_id -> Logprob`` of one position, each token's text ``tokenizer.decode([id])``
    (``None`` without a tokenizer)."""
    return {t: Logprob(v, r, tokenizer.decode([t]) if tokenizer is not None else None) for t, v, r in raw}


def attach_logprobs(requests: dict, result, tokenizer) -> None:
    """Append a step's log-probabilities (``result.logprobs``: request id -> the sampled token's
    :data:`RawLogprobs`; ``result.prompt_logprobs``: request id -> one per prompt token of the step's
    chunk) to ``requests[id].logprobs`` / ``.prompt_logprobs``."""
    for rid, raw in (result.logprobs or {}).items():
        requests[rid].logprobs.append(to_position(raw, tokenizer))
    for rid, raws in (result.prompt_logprobs or {}).items():
        req = requests[rid]
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        req.prompt_logprobs += [to_position(raw, tokenizer) for raw in raws]


def cumulative_logprob(req) -> float | None:
    """Sum of the log-probabilities of a request's output tokens (``None`` without ``logprobs``)."""
    if req.sampling_params.logprobs is None:
        return None
    return float(sum(pos[t].logprob for pos, t in zip(req.logprobs, req.output_token_ids)))


def step_logprobs(logits: torch.Tensor, reqs: list, sampled: list[int], prompt_rows: list) -> tuple[dict, dict]:
    """A step's log-probabilities, for the requests that asked.

    Args:
        logits: ``[len(reqs) + prompt rows, vocab_size]`` raw logits: the sampling rows (in ``reqs``'
            order), then each ``(request, lo, hi)`` of ``prompt_rows``' positions ``lo..hi-1``.
        sampled: the token sampled for each of ``reqs``.

    Returns:
        ``(logprobs, prompt_logprobs)``: request id -> the sampled token's :data:`RawLogprobs`;
        request id -> a :data:`RawLogprobs` per prompt token ``lo+1..hi`` (position p predicts token p+1).
    """
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    out: dict = {}
    if rows:
        raw = top_logprobs(logits[rows], [sampled[i] for i in rows], [reqs[i].sampling_params.logprobs for i in rows])
        out = {reqs[i].request_id: r for i, r in zip(rows, raw)}
    prompt: dict = {}
    first = len(reqs)
    for req, lo, hi in prompt_rows:
        chosen = req.prompt_token_ids[lo + 1 : hi + 1]
        ks = [req.sampling_params.prompt_logprobs] * (hi - lo)
        prompt[req.request_id] = top_logprobs(logits[first : first + hi - lo], chosen, ks)
        first += hi - lo
    return out, prompt


def any_logprobs(reqs: list) -> bool:
    """Whether a request among ``reqs`` asked for ``logprobs``."""
    return any(r.sampling_params.logprobs is not None for r in reqs)
