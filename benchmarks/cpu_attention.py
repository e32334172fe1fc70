"""Decode attention of one layer on the CPU: the C++ kernel (``attention_backend="cpu"``) against the PyTorch
reference's gather + SDPA (``"torch"``), on the same cache, block tables and lengths.

The shapes are the bundled SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64) unless told otherwise; the batch
is ``--num-seqs`` sequences of ``--context`` tokens, less a seeded 0-25% each (so the reference pads and masks as it
does in the engine), their blocks scattered over a pool of ``--num-blocks``. Both are timed call by call, alternating
(a drift of the machine's speed hits both alike); the script prints the median and 10th percentile of each and the
ratio of medians, and checks that the two agree (bfloat16: within 1e-2 of each other). In bfloat16 the earlier C++ kernel
(``rowwise=True``: one dot product per position and head) runs too, the same-run baseline of the 16-position one.

``--layers N`` gives each of N layers its own cache (same block tables and lengths, as in one engine step) and times
one pass over all N per call, printed per layer: with N = 30 (SmolLM2-135M's layers) the K and V a step reads are
far larger than the CPU's caches, as in the engine, where one layer alone mostly fits.

Usage::

    python benchmarks/cpu_attention.py                    # bfloat16, 64 sequences x 256 tokens, torch's threads
    python benchmarks/cpu_attention.py --dtype float32 --num-seqs 8 --context 2048 --threads 1
    python benchmarks/cpu_attention.py --layers 30 --calls 20   # out of cache, as one step's 30 layers
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from workbench.attention.torch_ref import AttentionMetadata, DecodeGroup, paged_attention
from workbench.kernels import cpu_attention


def make_case(args):
    """The query, ``args.layers`` pairs of K and V caches ``[num_blocks, block_size, kv_heads, head_dim]``, the
    block tables, lengths and the reference's metadata (one decode group)."""
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    bs, nkv, d, n = args.block_size, args.num_kv_heads, args.head_dim, args.num_seqs
    caches = [
        tuple(torch.randn(args.num_blocks, bs, nkv, d, generator=g).to(dtype) for _ in range(2))
        for _ in range(args.layers)
    ]
    q = torch.randn(n, args.num_heads, d, generator=g).to(dtype)
    lens = args.context - (torch.rand(n, generator=g) * 0.25 * args.context).long()
    width = -(-args.context // bs)
    tables = torch.randperm(args.num_blocks, generator=g)[: n * width].view(n, width)
    mask = (torch.arange(width * bs)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.long), n, [DecodeGroup(0, tables, mask, lens)], [], [], [])
    return q, caches, tables, lens, meta


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="(default bfloat16)")
    p.add_argument("--num-seqs", type=int, default=64, help="decode sequences in the batch (default 64)")
    p.add_argument("--context", type=int, default=256, help="longest context, tokens (default 256)")
    p.add_argument("--num-heads", type=int, default=9, help="the bundled SmolLM2-135M's shape (default 9)")
    p.add_argument("--num-kv-heads", type=int, default=3, help="the bundled SmolLM2-135M's shape (default 3)")
    p.add_argument("--head-dim", type=int, default=64, help="the bundled SmolLM2-135M's shape (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block, the engine's default (default 16)")
    p.add_argument("--num-blocks", type=int, default=4096, help="blocks in the pool (default 4096)")
    p.add_argument("--calls", type=int, default=200, help="timed calls of each (default 200)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--layers", type=int, default=1, help="layers, each with its own cache, per timed call (default 1)")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    if args.num_seqs * -(-args.context // args.block_size) > args.num_blocks:
        p.error("--num-blocks is too small for --num-seqs x --context")
    if args.threads:
        torch.set_num_threads(args.threads)
    if missing := cpu_attention.toolchain_missing():
        raise SystemExit(f"the C++ kernel cannot be built here: {missing}")
    q, caches, tables, lens, meta = make_case(args)
    kc = caches[0][0]
    scale = args.head_dim**-0.5

    def over_layers(one_layer):  # one call: every layer's cache in turn; returns the last layer's output
        return lambda: [one_layer(k, v) for k, v in caches][-1]

    systems = {
        "cpu (C++ kernel)": over_layers(
            lambda k, v: cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale)
        ),
        "torch (gather + SDPA)": over_layers(lambda k, v: paged_attention(q, None, None, k, v, meta, scale)),
    }
    if args.dtype == "bfloat16":  # the earlier C++ kernel, one dot product per position and head
        systems["cpu, row-wise (rowwise=True)"] = over_layers(
            lambda k, v: cpu_attention.paged_decode_attention(q, k, v, tables, lens, scale, rowwise=True)
        )
    outs = {name: f().float() for name, f in systems.items()}  # also the warm-up (and the kernel's build or load)
    diff = (outs["cpu (C++ kernel)"] - outs["torch (gather + SDPA)"]).abs().max().item()
    bound = 1e-2 if args.dtype == "bfloat16" else 1e-5
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.calls):
        for name, f in systems.items():
            t0 = time.perf_counter()
            f()
            times[name].append((time.perf_counter() - t0) / args.layers)
    where = "one layer" if args.layers == 1 else f"per layer of {args.layers}, each with its own cache"
    print(
        f"# decode attention, {where}: {args.num_seqs} sequences, context up to {args.context} tokens, "
        f"{args.num_heads} query / {args.num_kv_heads} KV heads x {args.head_dim}, block {args.block_size}, "
        f"{args.dtype}, {torch.get_num_threads()} threads, {args.calls} alternating calls each"
    )
    print("| backend | median per layer (ms) | p10 (ms) |\n|---|---:|---:|")
    med = {}
    for name, ts in times.items():
        ts.sort()
        med[name] = statistics.median(ts)
        print(f"| {name} | {med[name] * 1e3:.3f} | {ts[len(ts) // 10] * 1e3:.3f} |")
    print(f"reference / kernel, medians: {med['torch (gather + SDPA)'] / med['cpu (C++ kernel)']:.2f}x")
    if "cpu, row-wise (rowwise=True)" in med:
        print(f"row-wise / kernel, medians: {med['cpu, row-wise (rowwise=True)'] / med['cpu (C++ kernel)']:.2f}x")
    positions = int(lens.sum())
    print(
        f"kernel: {positions * 2 * kc[0, 0].numel() * kc.element_size() / med['cpu (C++ kernel)'] / 1e9:.1f} GB/s "
        f"of K and V ({positions} positions x {2 * kc[0, 0].numel() * kc.element_size()} bytes per call)"
    )
    print(f"largest difference between the two outputs: {diff:.2e} (bound {bound:g})")
    if diff > bound:
        raise SystemExit("the kernel and the reference disagree beyond the bound")


if __name__ == "__main__":
    main()
