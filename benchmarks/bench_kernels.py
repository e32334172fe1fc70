"""Triton paged-attention kernels on a GPU: decode memory bandwidth and prefill TFLOP/s, against the
device's peak and against the engine's PyTorch reference.

Decode attention reads every context token's K and V once per sequence and does little arithmetic
with it, so its figure of merit is **bytes of K/V read per second**: ``batch x context x num_kv_heads
x head_dim x 2 (K and V) x bytes per element`` over the kernel's time, compared with the device's
peak memory bandwidth (NVML: memory clock x bus width x 2, or the vendor figure by name, or
``--peak-gbs``) and with a device-to-device copy (what is achievable in practice). The grid is batch
x context x block size (8, 16, 32), for the single-pass kernel, the split-KV kernel and the automatic
choice between them; the PyTorch reference (:func:`workbench.attention.torch_ref.paged_attention`:
gather through the block tables, then SDPA) runs the same inputs. Prefill (whole prompts, and chunks
over a cached context) is reported in TFLOP/s: ``4 x num_heads x head_dim x (visible query-key
pairs)``, causal pairs only.

Times are medians of ``triton.testing.do_bench`` (L2 flushed before every run). Each configuration's
output is compared with the reference's (``max |err|``). Block tables are random permutations
(blocks scattered over the pool, as after a long serving run).

    python benchmarks/bench_kernels.py                     # full grid (CUDA), Llama-3-8B attention shape, bf16
    python benchmarks/bench_kernels.py --quick             # a smaller grid
    python benchmarks/bench_kernels.py --interpret         # no GPU: tiny sizes through Triton's interpreter,
                                                     # checks the script and the results; times mean nothing

Writes a markdown report on stdout and the raw figures to ``runs/bench/kernels.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workbench import kernels  # noqa: E402
from workbench.attention import AttentionMetadata, DecodeGroup, torch_ref  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: Peak DRAM bandwidth (GB/s) and dense fp16/bf16 tensor-core TFLOP/s from the vendors' datasheets,
#: matched by a substring of ``torch.cuda.get_device_name`` (first match wins; more specific first).
#: Used only when NVML cannot give the bandwidth, and for the prefill percentage.
DATASHEET = [
    ("H200", 4800, 989),
    ("H100 NVL", 3900, 835),
    ("H100 PCIe", 2000, 756),
    ("H100", 3350, 989),  # SXM5 80 GB ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039, 312),
    ("A100 80GB PCIe", 1935, 312),
    ("A100", 1555, 312),  # 40 GB
    ("L40S", 864, 362),
    ("L40", 864, 181),
    ("L4", 300, 121),
    ("A10G", 600, 70),
    ("A10", 600, 125),
    ("RTX 4090", 1008, 165),
    ("RTX 3090", 936, 71),
    ("V100", 900, 125),
    ("T4", 320, 65),
]


# ---------------------------------------------------------------------------- device
def datasheet(name: str) -> tuple[float | None, float | None]:
    for key, gbs, tflops in DATASHEET:
        if key.lower() in name.lower():
            return float(gbs), float(tflops)
    return None, None


def nvml_peak_gbs(index: int) -> float | None:
    """Peak DRAM bandwidth from NVML: max memory clock (MHz) x bus width (bits) x 2 (double data rate) / 8."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        finally:
            pynvml.nvmlShutdown()
        return mhz * 1e6 * 2 * bits / 8 / 1e9 if mhz and bits else None
    except Exception:  # noqa: BLE001 - no package, no driver, no such query: fall back to the datasheet
        return None


def device_info(args) -> dict:
    if args.interpret:
        return {"name": f"CPU ({platform.processor() or platform.machine()}), Triton interpreter", "interpret": True}
    idx = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(idx)
    name = torch.cuda.get_device_name(idx)
    ds_gbs, ds_tflops = datasheet(name)
    peak, source = args.peak_gbs, "--peak-gbs"
    if peak is None:
        peak, source = nvml_peak_gbs(idx), "NVML (memory clock x bus width x 2)"
    if peak is None and ds_gbs is not None:
        peak, source = ds_gbs, "vendor datasheet"
    return {
        "name": name,
        "capability": f"sm_{p.major}{p.minor}",
        "sms": p.multi_processor_count,
        "memory_gib": round(p.total_memory / 2**30, 1),
        "peak_gbs": peak,
        "peak_source": source if peak else "unknown (pass --peak-gbs)",
        "peak_tflops": args.peak_tflops or ds_tflops,
        "interpret": False,
    }


def bench(fn, interpret: bool) -> float:
    """Median seconds of ``fn()``."""
    if interpret:
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def copy_bandwidth(interpret: bool) -> float | None:
    """Achieved GB/s of a 1 GiB device-to-device copy (1 GiB read + 1 GiB written)."""
    if interpret:
        return None
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * 2**30 / bench(partial(y.copy_, x), False) / 1e9


# ---------------------------------------------------------------------------- inputs
def paged_inputs(batch, ctx_lens, bs, nh, nkv, d, dtype, device, seed=0):
    """K/V caches with each sequence's blocks at random places; block tables ``[batch, max_blocks]`` int32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    need = [-(-c // bs) for c in ctx_lens]
    nb = sum(need) + 1
    k_cache = torch.randn(nb, bs, nkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(nb, bs, nkv, d, dtype=dtype, device=device)
    perm = torch.randperm(nb, generator=g)
    width = max(need)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n].int()
        used += n
    return k_cache, v_cache, tables.to(device), torch.tensor(ctx_lens, dtype=torch.int32, device=device)


def kv_bytes(ctx_lens, nkv, d, dtype) -> int:
    return sum(ctx_lens) * nkv * d * 2 * torch.tensor([], dtype=dtype).element_size()


def decode_meta(tables, lens, bs) -> AttentionMetadata:
    """The reference backend's metadata for one group of one-token sequences."""
    width = tables.shape[1]
    mask = (torch.arange(width * bs, device=tables.device)[None, :] < lens[:, None].long())[:, None, None, :]
    group = DecodeGroup(0, tables.long(), mask, lens.long())
    return AttentionMetadata(lens.long(), len(lens), [group], [], [], [])


# ---------------------------------------------------------------------------- decode
def run_decode(args, dev: dict) -> list[dict]:
    rows = []
    for bs in args.block_sizes:
        for batch in args.batches:
            for ctx in args.contexts:
                nbytes = kv_bytes([ctx] * batch, args.num_kv_heads, args.head_dim, DTYPES[args.dtype])
                if nbytes > args.max_kv_gib * 2**30:
                    continue
                row = decode_one(args, dev, bs, batch, ctx, nbytes)
                rows.append(row)
                print(f"  decode bs={bs} batch={batch} ctx={ctx}: {row['gbs']:.1f} GB/s", file=sys.stderr, flush=True)
                if not args.interpret:
                    torch.cuda.empty_cache()
    return rows


def decode_one(args, dev: dict, bs: int, batch: int, ctx: int, nbytes: int) -> dict:
    """One decode configuration: single-pass, split-KV and the PyTorch reference, timed and compared."""
    from workbench.kernels.paged_attention import DEFAULT_PARTITION_SIZE, paged_decode_attention, use_split_kv

    interpret = args.interpret
    nh, nkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    scale = d**-0.5
    part = args.partition_size or DEFAULT_PARTITION_SIZE
    device = "cpu" if interpret else "cuda"
    kc, vc, tables, lens = paged_inputs(batch, [ctx] * batch, bs, nh, nkv, d, DTYPES[args.dtype], device)
    q = torch.randn(batch, nh, d, dtype=kc.dtype, device=device)
    out = torch.empty_like(q)
    call = partial(
        paged_decode_attention, q, kc, vc, tables, lens, scale, out=out, max_context_len=ctx,
        interpret=interpret or None,
    )  # fmt: skip
    row = dict(block_size=bs, batch=batch, context=ctx, kv_bytes=nbytes)
    row["single_s"] = bench(partial(call, partition_size=0), interpret)
    row["split_s"] = bench(partial(call, partition_size=part), interpret) if ctx > part or interpret else None
    split = use_split_kv(batch, nkv, ctx, q.device, part)
    row["chosen"] = "split" if split and row["split_s"] else "single"
    row["chosen_s"] = row["split_s"] if row["chosen"] == "split" else row["single_s"]
    row["gbs"] = nbytes / row["chosen_s"] / 1e9
    row["pct_peak"] = 100 * row["gbs"] / dev["peak_gbs"] if dev.get("peak_gbs") else None
    row["torch_s"] = row["speedup"] = row["max_err"] = None
    single = call(partition_size=0).clone()
    if row["split_s"] is not None:
        row["split_vs_single_err"] = (call(partition_size=part).float() - single.float()).abs().max().item()
    if 3 * nbytes <= args.max_ref_gib * 2**30:  # the reference gathers K/V (and casts) first
        ref_call = partial(torch_ref.paged_attention, q, q, q, kc, vc, decode_meta(tables, lens, bs), scale)
        row["torch_s"] = bench(ref_call, interpret)
        row["speedup"] = row["torch_s"] / row["chosen_s"]
        row["max_err"] = (single.float() - ref_call().float()).abs().max().item()
    return row


# ---------------------------------------------------------------------------- prefill
def causal_pairs(qlen: int, ctx: int) -> int:
    """Visible (query, key) pairs of a chunk of ``qlen`` new tokens ending a ``ctx``-token context."""
    first = ctx - qlen
    return qlen * first + qlen * (qlen + 1) // 2


def run_prefill(args, dev: dict) -> list[dict]:
    rows = []
    for batch, qlen, ctx in args.prefill_shapes:
        row = prefill_one(args, dev, batch, qlen, ctx)
        rows.append(row)
        print(f"  prefill batch={batch} q={qlen} ctx={ctx}: {row['tflops']:.1f} TFLOP/s", file=sys.stderr, flush=True)
        if not args.interpret:
            torch.cuda.empty_cache()
    return rows


def prefill_one(args, dev: dict, batch: int, qlen: int, ctx: int, bs: int = 16) -> dict:
    """One prefill configuration: the Triton kernel and the PyTorch reference, timed and compared."""
    from workbench.kernels.prefill_attention import paged_prefill_attention

    interpret = args.interpret
    device = "cpu" if interpret else "cuda"
    nh, nkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    scale = d**-0.5
    kc, vc, tables, lens = paged_inputs(batch, [ctx] * batch, bs, nh, nkv, d, DTYPES[args.dtype], device, seed=1)
    q = torch.randn(batch * qlen, nh, d, dtype=kc.dtype, device=device)
    qsl = torch.arange(0, (batch + 1) * qlen, qlen, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    flops = 4 * nh * d * causal_pairs(qlen, ctx) * batch
    run = partial(
        paged_prefill_attention, q, kc, vc, tables, qsl, lens, scale, max_query_len=qlen, out=out,
        interpret=interpret or None,
    )  # fmt: skip
    row = dict(batch=batch, query_len=qlen, context=ctx, flops=flops, block_size=bs)
    row["triton_s"] = bench(run, interpret)
    row["tflops"] = flops / row["triton_s"] / 1e12
    row["pct_peak"] = 100 * row["tflops"] / dev["peak_tflops"] if dev.get("peak_tflops") else None
    # the engine's reference: whole prompts attend over the fresh K/V (is_causal SDPA), chunks over the
    # gathered context with a mask
    meta = AttentionMetadata(
        torch.zeros(0, dtype=torch.long, device=device), 0, [], [qlen] * batch, [ctx] * batch,
        [tables[i, : -(-ctx // bs)].long() for i in range(batch)],
    )  # fmt: skip
    k_new = v_new = None
    if ctx == qlen:
        k_new = torch.cat([torch_ref.gather_kv(kc, tables[i].long(), ctx) for i in range(batch)])
        v_new = torch.cat([torch_ref.gather_kv(vc, tables[i].long(), ctx) for i in range(batch)])
    ref_call = partial(torch_ref.paged_attention, q, k_new, v_new, kc, vc, meta, scale)
    row["torch_s"] = bench(ref_call, interpret)
    row["torch_tflops"] = flops / row["torch_s"] / 1e12
    run()
    row["max_err"] = (out.float() - ref_call().float()).abs().max().item()
    return row


# ---------------------------------------------------------------------------- report
def fmt(x, spec: str = ".1f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


def report(res: dict) -> str:
    dev, a = res["device"], res["args"]
    lines = [
        f"GPU: **{dev['name']}**"
        + (f" ({dev['capability']}, {dev['sms']} SMs, {dev['memory_gib']} GiB)" if not dev.get("interpret") else ""),
        f"torch {res['torch']}, Triton {res['triton']}; {res['date']}",
    ]
    if not dev.get("interpret"):
        lines.append(
            f"Peak DRAM bandwidth {fmt(dev['peak_gbs'], '.0f')} GB/s ({dev['peak_source']}); "
            f"1 GiB device copy achieves {fmt(res['copy_gbs'], '.0f')} GB/s; peak dense 16-bit tensor "
            f"{fmt(dev['peak_tflops'], '.0f')} TFLOP/s."
        )
    else:
        lines.append(
            "Interpreter smoke run: times measure Python on the CPU, not a GPU; only max |err| means something."
        )
    lines.append(
        f"Attention shape: {a['num_heads']} query heads, {a['num_kv_heads']} KV heads, head_dim {a['head_dim']}, "
        f"{a['dtype']}."
    )
    lines += [
        "",
        "Decode (one query token per sequence; every sequence at the given context):",
        "",
        "| block | batch | context | single-pass µs | split-KV µs | chosen | K/V GB/s | % of peak | PyTorch ref µs "
        "| speed-up | max abs err |",
        "|---:|---:|---:|---:|---:|:--|---:|---:|---:|---:|---:|",
    ]
    for r in res["decode"]:
        lines.append(
            f"| {r['block_size']} | {r['batch']} | {r['context']} | {fmt(r['single_s'] * 1e6)} | "
            f"{fmt(r['split_s'] and r['split_s'] * 1e6)} | {r['chosen']} | {fmt(r['gbs'])} | {fmt(r['pct_peak'])} | "
            f"{fmt(r['torch_s'] and r['torch_s'] * 1e6)} | {fmt(r['speedup'], '.2f')}{'×' if r['speedup'] else ''} "
            f"| {fmt(r['max_err'], '.1e')} |"
        )
    lines += [
        "",
        "Prefill (causal; `context > query` = a chunk over cached context):",
        "",
        "| batch | query tokens | context | Triton µs | TFLOP/s | % of peak | PyTorch ref µs | ref TFLOP/s | max abs err |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["prefill"]:
        lines.append(
            f"| {r['batch']} | {r['query_len']} | {r['context']} | {fmt(r['triton_s'] * 1e6)} | {fmt(r['tflops'])} | "
            f"{fmt(r['pct_peak'])} | {fmt(r['torch_s'] * 1e6)} | {fmt(r['torch_tflops'])} | {fmt(r['max_err'], '.1e')} |"
        )
    long = [r["pct_peak"] for r in res["decode"] if r["pct_peak"] is not None and r["context"] >= 8192]
    if long:
        lines += [
            "",
            f"Decode at contexts >= 8192: {max(long):.0f}% of peak at best, {sorted(long)[len(long) // 2]:.0f}% median.",
        ]
    return "\n".join(lines)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"1x512x512,4x2048x2048"`` -> [(batch, query_len, context), ...]."""
    return [tuple(int(v) for v in s.split("x")) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interpret", action="store_true", help="no GPU: tiny sizes through Triton's interpreter")
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-sizes", default="8,16,32")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="512,2048,8192,32768")
    ap.add_argument("--prefill-shapes", default="1x512x512,1x2048x2048,1x8192x8192,4x2048x2048,1x512x8192,8x512x4096")
    ap.add_argument("--partition-size", type=int, default=None, help="split-KV partition (tokens; default 512)")
    ap.add_argument("--max-kv-gib", type=float, default=24.0, help="skip decode configs with more K/V than this")
    ap.add_argument("--max-ref-gib", type=float, default=48.0, help="skip the PyTorch reference above this")
    ap.add_argument("--peak-gbs", type=float, default=None, help="the device's peak DRAM bandwidth (GB/s)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak dense 16-bit TFLOP/s")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench" / "kernels.json"))
    args = ap.parse_args(argv)

    if not kernels.triton_available():
        ap.error("Triton is not installed: pip install triton (or pip install -e '.[triton]')")
    if args.interpret:
        args.dtype, args.num_heads, args.num_kv_heads, args.head_dim = "fp32", 4, 2, 64
        args.batches, args.contexts, args.prefill_shapes = "1,3", "17,100", "1x20x20,2x8x50"
        args.partition_size = 64
    elif not torch.cuda.is_available():
        print(
            "benchmarks/bench_kernels.py measures GPU memory bandwidth and needs a CUDA device; none is available here.\n"
            "Run it on a GPU machine (pip install -e '.[triton]'), or `python benchmarks/bench_kernels.py --interpret` for a "
            "smoke run of the script on tiny sizes through Triton's interpreter.",
            file=sys.stderr,
        )
        return 2
    elif kernels.interpreter_forced():
        ap.error("TRITON_INTERPRET=1 is set: unset it to measure compiled kernels, or pass --interpret")
    if args.quick:
        args.batches, args.contexts, args.block_sizes = "1,32", "2048,16384", "16"
        args.prefill_shapes = "1x2048x2048,1x512x8192"
    args.block_sizes = [int(v) for v in str(args.block_sizes).split(",")]
    args.batches = [int(v) for v in str(args.batches).split(",")]
    args.contexts = [int(v) for v in str(args.contexts).split(",")]
    args.prefill_shapes = parse_shapes(args.prefill_shapes)

    import triton

    torch.manual_seed(0)
    dev = device_info(args)
    res = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": dev,
        "args": {k: v for k, v in vars(args).items()},
        "copy_gbs": copy_bandwidth(args.interpret),
    }
    res["decode"] = run_decode(args, dev)
    res["prefill"] = run_prefill(args, dev)
    print(report(res))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    print(f"\n(raw figures: {out})", file=sys.stderr)
    bad = [
        r for r in res["decode"] + res["prefill"] if r.get("max_err") is not None and not math.isfinite(r["max_err"])
    ]
    tol = 1e-3 if args.dtype == "fp32" else 5e-2
    bad += [r for r in res["decode"] + res["prefill"] if r.get("max_err") is not None and r["max_err"] > tol]
    if bad:
        print(f"ERROR: {len(bad)} configuration(s) differ from the reference by more than {tol}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
