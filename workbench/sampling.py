"""The sampler (the parameters are :class:`~workbench.sampling_params.SamplingParams`, re-exported here).

As vLLM's: ``min_tokens`` and the repetition / frequency / presence penalties first (greedy rows too;
:mod:`workbench.sample_ops`), then greedy when ``temperature == 0``, else temperature scaling, top-k and
top-p (nucleus sampling, Holtzman et al., ICLR 2020), drawn from a per-request ``torch.Generator`` seeded by
``seed`` so that a run reproduces token for token.
"""

from __future__ import annotations

import torch

from workbench.sample_ops import process_rows, top_k_top_p
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
        row = top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1).cpu()  # the per-request generators live on the CPU
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
