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

__all__ = ["FLOAT32_MAX", "SAMPLING_FAILED", "RequestOutputKind", "SamplingError", "SamplingParams", "sample"]


#: the largest float32: a logit that overflows to +inf (a tiny repetition penalty divides it) is held here,
#: so that the tokens it stands for tie at the top instead of turning the softmax into NaN
FLOAT32_MAX = torch.finfo(torch.float32).max


#: how the error of a request whose row could not be sampled begins
SAMPLING_FAILED = "sampling failed for this request"


class SamplingError(ValueError):
    """A row whose logits leave no token to pick (NaN, or every token masked); its request ends with
    ``finish_reason="error"`` and this message, and the other rows of the step are sampled as usual."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    requests=None,
    errors: dict[int, str] | None = None,
) -> list[int]:
    """Pick one token per row; return ``num_seqs`` token ids (``logits`` itself is not modified).

    Args:
        logits: ``[num_seqs, vocab_size]``, any float dtype (computed in float32).
        params: one ``SamplingParams`` per row.
        generators: one generator per row (``None`` for greedy rows).
        requests: one per row, the token histories of penalties and ``min_tokens``
            (:func:`workbench.sample_ops.process_row`); ``None``: neither is applied.
        errors: where a row that cannot be sampled is reported (row index -> why; its token is then -1);
            ``None``: such a row raises :class:`SamplingError`.

    Numerics: penalties and temperature may push a logit past float32 (+inf); it is held at
    :data:`FLOAT32_MAX`. A row with a NaN logit or with no finite one (a mask over every token) cannot
    be sampled.
    """
    logits = process_rows(logits.float(), params, requests).clamp(max=FLOAT32_MAX)  # a new tensor
    usable = (torch.isfinite(logits).any(-1) & ~torch.isnan(logits).any(-1)).tolist()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        try:
            if not usable[i]:
                raise SamplingError(_unusable(logits[i]))
            if p.greedy:
                continue
            row = (logits[i] / p.temperature).clamp_(max=FLOAT32_MAX)
            row = top_k_top_p(row, p.top_k, p.top_p)
            probs = row.softmax(-1).cpu()  # the per-request generators live on the CPU
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
        except Exception as e:  # this row's request ends; the others are sampled
            if errors is None:
                raise
            errors[i] = f"{SAMPLING_FAILED}: {e}"
            out[i] = -1
    return out


def _unusable(row: torch.Tensor) -> str:
    if torch.isnan(row).any():
        return "the model's logits hold NaN"
    return "every token of the vocabulary is masked (no finite logit is left to sample from)"
