"""One process, one device: the model runner that turns a schedule into tensors and logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.attention import AttentionMetadata, DecodeGroup, get_backend
from workbench.kv.manager import KVCacheManager, cdiv
from workbench.model.llama import LlamaForCausalLM
from workbench.scheduler import ScheduledRequest, SchedulerOutput


@dataclass
class ModelInput:
    """Flat tensors of one step (see :class:`~workbench.attention.AttentionMetadata`).

    Attributes:
        input_ids: ``[num_tokens]`` int64.
        positions: ``[num_tokens]`` int64.
        meta: the paged-attention layout (slot mapping, block tables, context lengths).
        logits_indices: ``[num_sampling]`` int64, rows of the tokens that sample.
        sampling: the scheduled requests that sample, in the order of ``logits_indices``.
        order: every scheduled request in the order its tokens appear in ``input_ids`` (each
            contributes ``num_new_tokens`` consecutive tokens): decodes first, then the rest.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling: list[ScheduledRequest]
    order: list[ScheduledRequest] = field(default_factory=list)


def prepare_inputs(out: SchedulerOutput, kv: KVCacheManager, device: torch.device) -> ModelInput:
    """Lay out a step: one-token sequences first (batched decode path), then multi-token ones."""
    # one-token sequences sorted by context length, so that length groups are contiguous
    decodes = sorted((s for s in out.scheduled if s.num_new_tokens == 1), key=lambda s: s.start)
    prefills = [s for s in out.scheduled if s.num_new_tokens > 1]
    bs = kv.block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    logits_idx: list[int] = []
    sampling: list[ScheduledRequest] = []
    for s in decodes + prefills:
        req, start, n = s.request, s.start, s.num_new_tokens
        ids.extend(req.tokens(start, start + n))
        pos.extend(range(start, start + n))
        slots.extend(kv.slot_mapping(req.request_id, start, start + n))
        if s.samples:
            logits_idx.append(len(ids) - 1)
            sampling.append(s)

    def t(x):
        return torch.tensor(x, dtype=torch.long, device=device)

    groups = []
    i = 0
    while i < len(decodes):
        # a group spans context lengths (in blocks) within a factor of two: padding < 2x
        lo = cdiv(decodes[i].start + 1, bs)
        j = i
        while j < len(decodes) and cdiv(decodes[j].start + 1, bs) <= 2 * lo:
            j += 1
        members = decodes[i:j]
        width = cdiv(members[-1].start + 1, bs)
        tables = [kv.get_block_table(s.request.request_id)[:width] for s in members]
        ctx = t([s.start + 1 for s in members])
        mask = (torch.arange(width * bs, device=device)[None, :] < ctx[:, None])[:, None, None, :]
        groups.append(DecodeGroup(i, t([tb + [0] * (width - len(tb)) for tb in tables]), mask, ctx))
        i = j
    meta = AttentionMetadata(
        slot_mapping=t(slots),
        num_decode=len(decodes),
        decode_groups=groups,
        prefill_query_lens=[s.num_new_tokens for s in prefills],
        prefill_context_lens=[s.start + s.num_new_tokens for s in prefills],
        prefill_block_tables=[
            t(kv.get_block_table(s.request.request_id)[: cdiv(s.start + s.num_new_tokens, bs)]) for s in prefills
        ],
    )
    return ModelInput(t(ids), t(pos), meta, t(logits_idx), sampling, decodes + prefills)


class LocalExecutor:
    """Runs the model in this process and owns the KV cache tensors.

    Args:
        model: the loaded model (weights already on ``device`` in their dtype).
        num_blocks, block_size: the pool's shape.
        kv_dtype: dtype of the cache.
        device: where the cache lives.
        attention_backend: ``"auto"``, ``"torch"``, ``"triton"`` or ``"triton-interpret"``
            (:mod:`workbench.attention.backend`); the Triton backends also do the block copies.

    The cache of each layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device,
        num_cpu_blocks: int = 0,
        attention_backend: str = "auto",
    ):
        self.model = model
        self.attn_backend = get_backend(attention_backend, device)
        cfg = model.config
        attn = model.layers[0].self_attn  # KV heads of this rank's shard under tensor parallelism
        shape = (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        # zeros, not empty: attention reads whole blocks and masks the unwritten slots, and a NaN
        # bit pattern left in uninitialised memory would survive the mask (0 x NaN = NaN)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        self.device = torch.device(device)
        cpu_shape = (2, num_cpu_blocks, *shape[2:])
        pin = self.device.type == "cuda"
        self.cpu_caches = (
            [torch.zeros(cpu_shape, dtype=kv_dtype, pin_memory=pin) for _ in range(cfg.num_hidden_layers)]
            if num_cpu_blocks
            else []
        )

    def copy_blocks(
        self,
        swap_out: list[tuple[int, int]],
        copies: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        """Block copies of one step, in this order: device -> CPU (swap out), device -> device
        (copy-on-write), CPU -> device (swap in). Each pair is ``(src, dst)`` block ids."""
        if self.attn_backend.name != "torch":  # the Triton gather / copy / scatter kernels
            self.attn_backend.copy_blocks(self.kv_caches, self.cpu_caches, swap_out, copies, swap_in)
            return

        def idx(pairs, i, dev):
            return torch.tensor([p[i] for p in pairs], dtype=torch.long, device=dev)

        for layer, gpu in enumerate(self.kv_caches):
            if swap_out:
                cpu = self.cpu_caches[layer]
                cpu[:, idx(swap_out, 1, "cpu")] = gpu[:, idx(swap_out, 0, gpu.device)].to("cpu")
            if copies:
                gpu[:, idx(copies, 1, gpu.device)] = gpu[:, idx(copies, 0, gpu.device)]
            if swap_in:
                cpu = self.cpu_caches[layer]
                gpu[:, idx(swap_in, 1, gpu.device)] = cpu[:, idx(swap_in, 0, "cpu")].to(gpu.device)

    @torch.inference_mode()
    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        """Logits ``[num_sampling, vocab_size]`` (float32) of the sampling tokens."""
        inp.meta.backend = self.attn_backend
        return self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, inp.logits_indices)
