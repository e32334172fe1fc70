"""What watching a run live costs: the same generate() with and without a LiveMonitor attached.

For each model (the bundled SmolLM2-135M-Instruct, whose CPU steps take tens of ms, and a tiny
random-weight Llama, whose steps take a few ms: the worst case for a per-step callback) the
script builds one ``LLM``, runs a warm-up, then ``--repeats`` pairs of runs, interleaved
(without/with, then with/without, ...), and reports the median wall time of each arm and their
ratio. The "with" arm is ``LiveMonitor(llm, refresh_s)`` + ``generate`` + ``close()`` (its final
redraw); building the widget is a one-off cost reported apart. Both arms use the same engine
arguments (``block_map_every`` included), so producing block maps costs the same in both and
the ratio is the monitor's cost alone.

Without a notebook front end, ipywidgets sends through a dummy comm that drops messages. To
include what a kernel does with them, the script replaces ``comm.create_comm`` with a comm that
JSON-encodes every message like ipykernel's session does (``json.dumps``, ``ensure_ascii=False``,
``allow_nan=False``) and counts the bytes; the ZMQ send and the browser's rendering (in another
process) are not included. ``--dummy-comm`` measures without the encoding.

    python benchmarks/live_monitor.py                      # both models, 3 repeats each
    python benchmarks/live_monitor.py --models tiny --repeats 1 --max-tokens 16    # smoke (~20 s)

Writes ``runs/bench/live_monitor.json``; results in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


class JsonComm:
    """Stands in for ipykernel's comm: encodes each message to JSON, as the kernel's session would."""

    bytes_sent = 0
    messages = 0

    @classmethod
    def install(cls) -> None:
        import comm

        base = comm.DummyComm

        class _Comm(base):
            def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
                payload = json.dumps(
                    {"msg_type": msg_type, "data": data, "metadata": metadata or {}, **keys},
                    ensure_ascii=False,
                    allow_nan=False,
                    default=str,
                )
                cls.bytes_sent += len(payload) + sum(len(memoryview(b).cast("B")) for b in buffers or ())
                cls.messages += 1

        comm.create_comm = lambda *a, **kw: _Comm(*a, **kw)


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import ipywidgets
    import plotly

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "plotly": plotly.__version__,
        "ipywidgets": ipywidgets.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def make_tiny_llama(folder: Path) -> Path:
    """A random-weight Llama (as tests/conftest.py builds it): 2 layers, hidden 64, vocab 256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=255,
        bos_token_id=1,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder


def workload(model: str, args, tmp: Path):
    """``(LLM, prompts, max_tokens)`` for one model."""
    from workbench import LLM
    from workbench.bench.datasets import default_prompts

    common = dict(block_map_every=args.block_map_every, max_num_seqs=args.max_num_seqs)
    if model == "bundled":
        llm = LLM(dtype="float32", max_model_len=512, **common)
        texts = [r.prompt for r in default_prompts() if isinstance(r.prompt, str) and len(r.prompt) < 400]
        prompts = [[{"role": "user", "content": t}] for t in texts[: args.num_prompts]]
        max_tokens = args.max_tokens
    else:
        folder = make_tiny_llama(tmp / "tiny-llama")
        llm = LLM(model=str(folder), max_model_len=512, block_size=16, num_gpu_blocks_override=1024, **common)
        rng = random.Random(0)
        n = args.tiny_num_prompts
        prompts = [[rng.randrange(2, 255) for _ in range(rng.randrange(16, 96))] for _ in range(n)]
        max_tokens = args.tiny_max_tokens
    return llm, prompts, max_tokens


def one_run(llm, prompts, sp, with_monitor: bool, refresh_s: float) -> dict:
    from workbench.viz.live import LiveMonitor

    rec = llm.llm_engine.recorder
    first_step = len(rec.steps)
    out: dict = {"monitor": with_monitor}
    mon = None
    if with_monitor:
        t = time.perf_counter()
        mon = LiveMonitor(llm, refresh_s=refresh_s)
        out["build_s"] = time.perf_counter() - t
    b0, m0 = JsonComm.bytes_sent, JsonComm.messages
    t, c = time.perf_counter(), time.process_time()
    llm.generate(prompts, sp)
    if mon is not None:
        tc = time.perf_counter()
        mon.close()
        out["close_s"] = time.perf_counter() - tc
    out["wall_s"] = time.perf_counter() - t
    out["cpu_s"] = time.process_time() - c  # CPU seconds of all this process's threads
    steps = rec.steps[first_step:]
    out["steps"] = len(steps)
    out["step_wall_s"] = sum(s.wall_time_s for s in steps)
    rec.steps.clear()  # keep the recorder small between runs (the monitor reads its own list)
    rec.requests.clear()
    if hasattr(rec, "block_maps"):
        rec.block_maps.clear()
    if mon is not None:
        out.update(
            redraws=mon.num_redraws,
            redraw_s=mon.redraw_time_s,
            callback_s=mon.callback_time_s,
            monitor_s=mon.callback_time_s + out["close_s"],  # all the monitor's work: callbacks + final close
            comm_bytes=JsonComm.bytes_sent - b0,
            comm_messages=JsonComm.messages - m0,
        )
    return out


def bench_model(model: str, args, tmp: Path) -> dict:
    from workbench import SamplingParams

    llm, prompts, max_tokens = workload(model, args, tmp)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    one_run(llm, prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), True, args.refresh_s)  # warm-up
    runs = []
    for i in range(args.repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        for with_monitor in order:
            r = one_run(llm, prompts, sp, with_monitor, args.refresh_s)
            runs.append(r)
            print(
                f"  {model} repeat {i + 1} monitor={with_monitor}: {r['wall_s']:.3f} s, {r['steps']} steps", flush=True
            )
    off = [r["wall_s"] for r in runs if not r["monitor"]]
    on = [r for r in runs if r["monitor"]]
    med_off = statistics.median(off)
    med_on = statistics.median(r["wall_s"] for r in on)
    return {
        "model": model,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "steps_per_run": runs[0]["steps"],
        "median_wall_off_s": med_off,
        "median_wall_on_s": med_on,
        "ratio_on_off": med_on / med_off,
        "min_max_off_s": [min(off), max(off)],
        "min_max_on_s": [min(r["wall_s"] for r in on), max(r["wall_s"] for r in on)],
        "median_redraws": statistics.median(r["redraws"] for r in on),
        "median_cpu_off_s": statistics.median(r["cpu_s"] for r in runs if not r["monitor"]),
        "median_cpu_on_s": statistics.median(r["cpu_s"] for r in on),
        "median_monitor_s": statistics.median(r["monitor_s"] for r in on),
        "monitor_share_of_off": statistics.median(r["monitor_s"] for r in on) / med_off,
        "median_redraw_ms": statistics.median(1e3 * r["redraw_s"] / max(1, r["redraws"]) for r in on),
        "median_comm_kib": statistics.median(r["comm_bytes"] / 1024 for r in on),
        "median_build_s": statistics.median(r["build_s"] for r in on),
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bundled,tiny", help="comma-separated: bundled, tiny")
    ap.add_argument("--num-prompts", type=int, default=16, help="bundled model")
    ap.add_argument("--max-tokens", type=int, default=64, help="bundled model")
    ap.add_argument("--tiny-num-prompts", type=int, default=64)
    ap.add_argument("--tiny-max-tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--refresh-s", type=float, default=0.25)
    ap.add_argument("--block-map-every", type=int, default=4, help="engine's block_map_every, in both arms")
    ap.add_argument("--dummy-comm", action="store_true", help="do not JSON-encode widget messages")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench" / "live_monitor.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.dummy_comm:
        JsonComm.install()
    info = machine()
    if info["loadavg_1m"] > 0.5:
        print(f"warning: 1-minute load average {info['loadavg_1m']:.2f} > 0.5; timings will be noisy")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            results.append(bench_model(model.strip(), args, Path(tmp)))
    info["loadavg_1m_end"] = os.getloadavg()[0]
    print()
    print(
        "| model | steps/run | wall off (s) | wall on (s) | on/off | CPU on/off | redraws | ms/redraw | "
        "monitor's own time (s) | ÷ wall off | widget messages (KiB) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['model']} | {r['steps_per_run']} | {r['median_wall_off_s']:.3f} | {r['median_wall_on_s']:.3f} | "
            f"{r['ratio_on_off']:.3f} | {r['median_cpu_on_s'] / r['median_cpu_off_s']:.3f} | "
            f"{r['median_redraws']:.0f} | {r['median_redraw_ms']:.1f} | {r['median_monitor_s']:.3f} | "
            f"{r['monitor_share_of_off']:.2%} | {r['median_comm_kib']:.0f} |"
        )
    print(f"load average: {info['loadavg_1m']:.2f} at start, {info['loadavg_1m_end']:.2f} at end")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "args": vars(args), "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
