"""Sampling parameters and the sampler.

``SamplingParams`` mirrors vLLM's (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html): greedy when
``temperature == 0``; otherwise temperature scaling, then top-k, then top-p (nucleus sampling, Holtzman et al.,
ICLR 2020), drawn from a per-request ``torch.Generator`` seeded by ``seed`` so that a run reproduces token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to pick each new token; raises ``ValueError`` (naming the value and the fix) when a field is out of range.

    Attributes:
        temperature: 0 = greedy (argmax); > 0 divides the logits.
        top_k: keep the k most likely tokens (-1 or 0 = all).
        top_p: keep the smallest set of tokens whose probability sums to >= top_p (1 = all).
        seed: seed of this request's generator; ``None`` = derived from the engine's seed and the arrival order.
        max_tokens: most new tokens to generate.
        stop_token_ids: token ids that end the request (kept in the output).
        ignore_eos: keep generating past the model's EOS token.
        n: output sequences per prompt; they share the prompt's KV blocks (copy-on-write).
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = no nucleus cut)")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all tokens) or a positive count")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1 (sequences per prompt)")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row; return ``num_seqs`` token ids.

    Args:
        logits: ``[num_seqs, vocab_size]``, any float dtype (computed in float32).
        params: one ``SamplingParams`` per row.
        generators: one generator per row (``None`` for greedy rows).
    """
    logits = logits.float()
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
            # drop a token when the tokens before it already reach top_p
            drop = probs.cumsum(-1) - probs >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, idx, sorted_logits)
        probs = row.softmax(-1).cpu()  # the per-request generators live on the CPU
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
