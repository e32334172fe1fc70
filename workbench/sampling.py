"""The sampler (the parameters are :class:`~workbench.sampling_params.SamplingParams`, re-exported here).

As vLLM's: ``min_tokens`` and the repetition / frequency / presence penalties first (greedy rows too;
:mod:`workbench.sample_ops`), then greedy when ``temperature == 0``, else temperature scaling, top-k and
top-p (nucleus sampling, Holtzman et al., ICLR 2020), drawn from a per-request ``torch.Generator`` seeded by
``seed`` so that a run reproduces token for token.
"""

from __future__ import annotations

import torch

from workbench.sample_ops import process_rows
from workbench.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["RequestOutputKind", "SamplingParams", "sample"]


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None], requests=None
) -> list[int]:
    """Pick one token per row; return ``num_seqs`` token ids (``logits`` itself is not modified).

    Args:
        logits: ``[num_seqs, vocab_size]``, any float dtype (computed in float32).
        params: one ``SamplingParams`` per row.
        generators: one generator per row (``None`` for greedy rows).
        requests: one per row, the token histories of penalties and ``min_tokens``
            (:func:`workbench.sample_ops.process_row`); ``None``: neither is applied.
    """
    logits = process_rows(logits.float(), params, requests)
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, idx = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the tokens before it already reach top_p; never the most likely one (a
            # top_p that rounds to 0 in float32 would otherwise drop them all)
            drop = probs.cumsum(-1) - probs >= p.top_p
            drop[0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
        probs = row.softmax(-1).cpu()  # the per-request generators live on the CPU
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
