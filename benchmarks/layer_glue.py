"""The element-wise work between a decoder layer's matmuls, eager vs ``torch.compile``: is fusing it worth it?

A Llama layer's forward is four matmuls (fused QKV, O, fused gate/up, down), paged attention, and the glue between
them: two RMSNorms, the RoPE rotation of q and k, two residual adds, SiLU and the gate product. The engine runs the
glue eagerly as a dozen small ops per layer (``workbench/model/llama.py``: RoPE tables looked up once per step,
q and k rotated together, ``torch.rms_norm``). This script times exactly that glue, for the bundled model's
shapes and dtype, at a full decode batch (64 tokens) and a full prefill chunk (2,048 tokens):

* ``eager``: the model's own modules and functions, as the engine calls them;
* ``compiled``: the same function under ``torch.compile`` (Inductor's C++ backend fuses it into a few loops),
  with its one-off compile time;

and puts the difference per engine step (x layers) next to the layer's matmul time at the same token count,
so that the possible gain is a share of the step. Example::

    python benchmarks/layer_glue.py                 # bfloat16 (the engine's dtype where the CPU has it)
    python benchmarks/layer_glue.py --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "runs" / "bench" / "layer_glue.json"


def median_time(f, repeats: int = 30) -> float:
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--tokens", default="64,2048", help="token counts (default 64,2048)")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)

    from workbench.config import EngineConfig
    from workbench.model.llama import RMSNorm, RotaryEmbedding, apply_rotary
    from workbench.model.loader import load_model

    cfg = EngineConfig(dtype=args.dtype)
    dtype = cfg.torch_dtype
    hf = load_model(cfg.model, cfg.resolved_cache_dir, cfg.tokenizer).hf_config
    h, nh, nkv = hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads
    d = h // nh
    inter = hf.intermediate_size
    norm1, norm2 = RMSNorm(h, hf.rms_norm_eps).to(dtype), RMSNorm(h, hf.rms_norm_eps).to(dtype)
    rotary = RotaryEmbedding(hf, 4096)

    def glue(x, qkv, attn_out, gate_up, down_out, rope):
        """What one layer does around its matmuls and attention (the matmul outputs are given)."""
        t = x.shape[0]
        y = norm1(x)  # -> QKV matmul
        qk = qkv[:, : (nh + nkv) * d].view(t, nh + nkv, d)
        qk = apply_rotary(qk, *rope)  # -> attention
        x = x + attn_out  # after O
        y2 = norm2(x)  # -> gate/up matmul
        g, u = gate_up.split(inter, dim=-1)
        act = F.silu(g) * u  # -> down matmul
        return x + down_out, y, qk, y2, act

    compiled = torch.compile(glue, dynamic=False)
    from workbench.model.cpu_pack import can_prepack, pack_weight, packed_linear

    shapes = {"qkv": ((nh + 2 * nkv) * d, h), "o": (h, nh * d), "gate_up": (2 * inter, h), "down": (h, inter)}
    weights = {k: torch.randn(*v).to(dtype) for k, v in shapes.items()}
    if can_prepack(dtype, "cpu"):  # as the engine multiplies: oneDNN-packed bfloat16 weights
        packed = {k: pack_weight(w) for k, w in weights.items()}

        def linear(x, name):
            return packed_linear(x, packed[name], None)
    else:

        def linear(x, name):
            return F.linear(x, weights[name])

    def measure(t: int) -> dict:
        x = torch.randn(t, h).to(dtype)
        qkv, attn_out = torch.randn(t, (nh + 2 * nkv) * d).to(dtype), torch.randn(t, h).to(dtype)
        gate_up, down_out = torch.randn(t, 2 * inter).to(dtype), torch.randn(t, h).to(dtype)
        act = torch.randn(t, inter).to(dtype)
        a = (x, qkv, attn_out, gate_up, down_out, rotary(torch.arange(t) % 4096, dtype))
        t0 = time.perf_counter()
        compiled(*a)
        compile_s = time.perf_counter() - t0
        eager_s = median_time(lambda: glue(*a))
        comp_s = median_time(lambda: compiled(*a))
        mm_s = median_time(lambda: (linear(x, "qkv"), linear(attn_out, "o"), linear(x, "gate_up"), linear(act, "down")))
        return {
            "tokens": t,
            "eager_ms_per_layer": eager_s * 1e3,
            "compiled_ms_per_layer": comp_s * 1e3,
            "compile_s": compile_s,
            "matmul_ms_per_layer": mm_s * 1e3,
            "saved_ms_per_step": (eager_s - comp_s) * 1e3 * hf.num_hidden_layers,
            "glue_share_of_glue_plus_matmul": eager_s / (eager_s + mm_s),
        }

    rows = []
    with torch.inference_mode():
        for t in [int(x) for x in args.tokens.split(",")]:
            row = measure(t)
            rows.append(row)
            print(
                f"{t:>5} tokens: glue eager {row['eager_ms_per_layer']:.3f} ms/layer, compiled "
                f"{row['compiled_ms_per_layer']:.3f} ms/layer (compiled in {row['compile_s']:.1f}s), matmuls "
                f"{row['matmul_ms_per_layer']:.3f} ms/layer; glue = {row['glue_share_of_glue_plus_matmul']:.1%} of "
                f"glue + matmuls; compiling would save {row['saved_ms_per_step']:.2f} ms per step "
                f"({hf.num_hidden_layers} layers)",
                flush=True,
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "layer_glue",
        "command": " ".join(["python", "benchmarks/layer_glue.py", *(sys.argv[1:] if argv is None else argv)]),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_num_threads": torch.get_num_threads(),
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
