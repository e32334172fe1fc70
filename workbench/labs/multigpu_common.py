"""What the multi-GPU chapters (9, 10, 15) share: the simulator runs (:func:`sim_run_row` prices a
Megatron-style split of a catalogue model on named GPUs with NVLink or PCIe links, :mod:`workbench.sim`),
real tensor-parallel engines kept for the session (:func:`tp_engine`, :func:`tp_run`), and the base of
their panels (widgets named like the engine arguments, a Run button, a plot).

The chapters' own code is in :mod:`workbench.labs.ch09_tensor_parallelism`,
:mod:`workbench.labs.ch10_nccl_buffers` and :mod:`workbench.labs.ch15_memory_beside_kv`; each re-exports
what its notebook uses from here.
"""

from __future__ import annotations

import html
import threading
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from workbench.labs.panel import RunButtonThread, _accepts
from workbench.labs.runs import LAB_ENGINE_DEFAULTS, lab_run, lab_trace

MiB = 1 << 20

__all__ = [
    "MiB",
    "PCIE_GEN4_LINK",
    "burst_trace",
    "close_engines",
    "long_trace",
    "model_dims",
    "sim_budget",
    "sim_hardware",
    "sim_run_row",
    "sim_table",
    "tp_engine",
    "tp_run",
    "tp_trace",
]


# ====================================================================== simulator (chapters 9 and 10)
#: one-direction bandwidth and hop latency of a PCIe Gen4 x16 link, as the catalogue's PCIe cards (L4)
PCIE_GEN4_LINK = {"link_bandwidth": 32 * 10**9, "link_latency_s": 5e-6}


def sim_hardware(gpu: str = "A100-80GB", interconnect: str = "NVLink"):
    """A catalogue GPU with its own links (``"NVLink"``), or the same GPU with PCIe Gen4 x16 links
    (``"PCIe"``: a what-if — same FLOP/s, HBM and capacity, only the GPU-to-GPU link changed, so
    that the comparison isolates the interconnect).

    Raises:
        ValueError: an unknown GPU (names the catalogue) or interconnect.
    """
    from workbench.sim.hardware import find_hardware

    hw = find_hardware(gpu)
    if interconnect == hw.interconnect:
        return hw
    if interconnect == "PCIe":
        return hw.with_changes(
            name=f"{hw.name} (PCIe links)",
            interconnect="PCIe",
            link_source="what-if: PCIe Gen4 x16, 32 GB/s one direction, 5 µs per hop (as the catalogue's L4)",
            **PCIE_GEN4_LINK,
        )
    raise ValueError(f"interconnect={interconnect!r}: {hw.name} has {hw.interconnect}; use 'NVLink' or 'PCIe'")


def burst_trace(num_requests: int = 128, dataset: str = "sharegpt", seed: int = 0):
    """``num_requests`` requests that all arrive at t = 0 (offline throughput), with ShareGPT-like
    (or Alpaca-like) lengths from :func:`workbench.sim.trace.make_trace`'s seeded draw.

    Raises:
        ValueError: ``num_requests < 1`` or an unknown dataset.
    """
    from workbench.sim.trace import TraceRequest, make_trace

    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    t = make_trace(1000.0, 2 * num_requests / 1000.0 + 1.0, dataset, "poisson", seed)[:num_requests]
    return [TraceRequest(0.0, r.prompt_len, r.output_len, r.eos) for r in t]


def sim_run_row(
    model: str = "llama-2-70b",
    gpu: str = "A100-80GB",
    interconnect: str | None = None,
    tensor_parallel_size: int = 4,
    trace=None,
    spec: dict[str, Any] | None = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """One simulator run (:func:`workbench.sim.run.simulate_job`, nothing written) and its figures.

    Args:
        model: a catalogue model; gpu: a catalogue GPU; interconnect: ``None`` (the GPU's own),
            ``"NVLink"`` or ``"PCIe"`` (:func:`sim_hardware`).
        tensor_parallel_size: GPUs the model is split over.
        trace: requests (default :func:`burst_trace`).
        spec: further :class:`~workbench.sim.SimSpec` fields (``activation_bytes``, ``custom_all_reduce``).
        **engine_args: engine arguments (``block_size``, ``max_num_seqs``, ``nccl_buffsize``,
            ``nccl_min_nchannels``, ``nccl_max_nchannels``, ``nccl_proto``, ...); ``max_model_len``
            defaults to 4096, ``max_num_seqs`` to 256.

    Returns:
        ``{"gpu", "interconnect", "tensor_parallel_size", "num_blocks", "comm_buffer_bytes",
        "output_tok_s", "output_tok_s_per_gpu", "tpot_p50_ms", "ttft_p50_s", "allreduce_share",
        "peak_running", "duration_s"}`` — simulated seconds; ``allreduce_share`` = simulated
        all-reduce seconds / step seconds over the run.

    Raises:
        ValueError: a size that does not split the model, a budget without room for one sequence,
            bad engine arguments (each names the value and the fix).
    """
    from workbench.catalog import MODELS
    from workbench.sim import SimSpec
    from workbench.sim.run import simulate_job

    if model not in MODELS:
        raise ValueError(f"model={model!r} is not in the catalogue; use one of {', '.join(MODELS)}")
    hw = sim_hardware(gpu, interconnect or _own_link(gpu))
    trace = trace if trace is not None else burst_trace()
    args = {"max_model_len": 4096, "max_num_seqs": 256} | engine_args
    sim_spec = SimSpec(MODELS[model], hw, tensor_parallel_size, **(spec or {}))
    res = simulate_job(sim_spec, trace, output_dir=None, **args)
    steps = res.engine.recorder.steps
    wall = sum(s.wall_time_s for s in steps)
    comm = sum(s.comm_time_s for s in steps)
    s = res.summary
    return {
        "model": model,
        "gpu": gpu,
        "interconnect": hw.interconnect,
        "tensor_parallel_size": tensor_parallel_size,
        "num_blocks": res.engine.memory.num_blocks,
        "comm_buffer_bytes": res.engine.memory.comm_buffer_bytes,
        "output_tok_s": s["output_throughput_tok_s"],
        "output_tok_s_per_gpu": s["output_throughput_tok_s"] / tensor_parallel_size,
        "tpot_p50_ms": 1e3 * s["tpot_p50_s"],
        "ttft_p50_s": s["ttft_p50_s"],
        "allreduce_share": comm / wall if wall else 0.0,
        "peak_running": max((x.num_running for x in steps), default=0),
        "duration_s": s["simulated_duration_s"],
    }


def _own_link(gpu: str) -> str:
    from workbench.sim.hardware import find_hardware

    return find_hardware(gpu).interconnect


def sim_table(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()):
    """Simulator rows (:func:`sim_run_row`) as a :class:`~workbench.viz.table.Table` (simulated figures,
    rounded): the ``extra`` keys first (e.g. ``"config"``), then GPUs, link, KV blocks, throughput,
    per-GPU throughput, TPOT and TTFT p50, and the all-reduce share of the step time. Rows: the given rows, ``gpus`` (``"N x GPU"``) added."""
    from workbench.viz.table import Column, Table

    cols = [Column(k, k, str, align="left") for k in extra] + [
        Column("gpus", "GPUs", str),
        Column("interconnect", "link", str, align="left"),
        Column("num_blocks", "KV (blocks)", "{:,}".format),
        Column("output_tok_s", "output (tok/s)", "{:,.0f}".format),
        Column("output_tok_s_per_gpu", "per GPU (tok/s)", "{:,.0f}".format),
        Column("tpot_p50_ms", "TPOT p50 (ms)", "{:.1f}".format),
        Column("ttft_p50_s", "TTFT p50 (s)", "{:.2f}".format),
        Column("allreduce_share", "all-reduce (% of step)", "{:.1%}".format),
    ]
    return Table(cols, [dict(r) | {"gpus": f"{r['tensor_parallel_size']} x {r['gpu']}"} for r in rows])


# ====================================================================== panels
class _Panel(RunButtonThread):
    """Widgets + Run button + status line; ``run(**overrides)`` is the button's code path."""

    controls: dict

    def _build(self, controls: dict, plot) -> None:
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        self._w = w
        self.controls = controls
        self.result = None
        self.status_text = ""  # the status line as plain text (its widget shows it as HTML)
        self.history: list[tuple[dict, Any]] = []
        self._init_button(w)
        self.plot = plot
        grid = w.GridBox(list(controls.values()), layout=w.Layout(grid_template_columns="repeat(2, 50%)"))
        self.widget = w.VBox([grid, w.HBox([self.button, self.status]), plot])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def current_values(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def run(self, **overrides: Any):
        """Run with the widgets' values and ``overrides`` (which also move the widgets when they
        can show them). Raises what the run raises (also shown in the status line)."""
        for k in overrides:
            if k not in self.controls:
                why = f"unknown control {k!r}; this panel has {', '.join(self.controls)}"
                self._show_error(f"ValueError: {why}")
                raise ValueError(why)
        values = self.current_values() | overrides
        return self._locked(values, {k: v for k, v in overrides.items() if _accepts(self.controls[k], v)})

    def _execute(self, values: dict[str, Any]):
        try:
            with self._busy():
                res = self._run(values)
        except Exception:
            self.status_text = (
                self.error or ""
            )  # the plain-text status follows the widget's: the error, not the last run
            raise
        self.result = res
        self.history.append((values, res))
        self.status_text = self._describe(values, res)
        # monospace like a log line, but wrapped between words (a <pre> broke words at the edge)
        self.status.value = (
            f'<span style="font-family:monospace;white-space:normal">{html.escape(self.status_text)}</span>'
        )
        return res

    @abstractmethod
    def _run(self, values):
        """Start the panel's run (a real engine run or a simulator run) for these widget values."""

    @abstractmethod
    def _describe(self, values, res) -> str:
        """The status line after a successful run."""


# ---------------------------------------------------------------- simulated budgets and long traces (chapters 10 and 15)
def sim_budget(model: str, gpu: str, tensor_parallel_size: int, spec: dict[str, Any] | None = None, **engine_args: Any):
    """The simulated engine's memory budget (``MemoryBudget``; buffers from the ``nccl_*`` arguments;
    ``spec``: further :class:`~workbench.sim.SimSpec` fields, e.g. ``custom_all_reduce``)."""
    from workbench.catalog import MODELS
    from workbench.config import EngineConfig
    from workbench.sim import SimEngine, SimSpec

    args = {"max_model_len": 4096, "max_num_seqs": 256} | engine_args
    eng = SimEngine(
        EngineConfig(**args),
        SimSpec(MODELS[model], sim_hardware(gpu, _own_link(gpu)), tensor_parallel_size, **(spec or {})),
    )
    return eng.memory


def long_trace(num_requests: int = 256, seed: int = 0):
    """Requests long enough that the KV pool binds at TP=4 (prompts 1,500-3,000 tokens, outputs
    200-400, uniform, seeded, EOS ignored), all arriving at t = 0."""
    import numpy as np

    from workbench.sim.trace import TraceRequest

    rng = np.random.default_rng(seed)
    prompts = rng.integers(1500, 3000, num_requests)
    outputs = rng.integers(200, 400, num_requests)
    return [TraceRequest(0.0, int(p), int(o), False) for p, o in zip(prompts, outputs)]


# ---------------------------------------------------------------- real tensor-parallel engines (chapters 9 and 15)
def tp_trace(num_requests: int = 4, max_output: int = 8, seed: int = 0):
    """The chapter's small trace: ``num_requests`` short real prompts (at most 200 characters),
    seeded output lengths of at most ``max_output`` tokens (:func:`~workbench.labs.runs.lab_trace`).

    Small on purpose: a TP=3 engine runs three processes on this machine's cores, and every
    step is 64 collectives."""
    return lab_trace(num_requests, mean_output=max_output / 2, max_output=max_output, seed=seed, max_prompt_chars=200)


_ENGINES: dict[int, tuple[dict, Any]] = {}


_ENGINES_LOCK = threading.Lock()


def tp_engine(tensor_parallel_size: int, **engine_args: Any):
    """A real engine (``LLM``) at ``tensor_parallel_size``, built once and kept for the session.

    The same arguments return the same engine (a TP=3 engine's two worker processes each load
    the model: building one costs tens of seconds on a 2-core machine). Only one
    tensor-parallel group can exist in a process, so building a TP > 1 engine with other
    arguments shuts the previous TP > 1 engine down first. :func:`close_engines` stops them all.

    Args:
        tensor_parallel_size: ranks (the bundled model takes 1 or 3: 9 heads, 3 KV heads).
        **engine_args: :class:`~workbench.config.EngineConfig` fields over the lab defaults.

    Raises:
        ValueError: a size that does not split the model (names the valid sizes), bad arguments.
    """
    from workbench.entrypoints.llm import LLM

    args = LAB_ENGINE_DEFAULTS | engine_args | {"tensor_parallel_size": tensor_parallel_size}
    with _ENGINES_LOCK:
        held = _ENGINES.get(tensor_parallel_size)
        if held is not None and held[0] == args and _alive(held[1]):
            return held[1]
        if held is not None:
            held[1].shutdown()
            del _ENGINES[tensor_parallel_size]
        if tensor_parallel_size > 1:  # one process group per process
            for tp in [t for t in _ENGINES if t > 1]:
                _ENGINES.pop(tp)[1].shutdown()
        llm = LLM(**args)
        _ENGINES[tensor_parallel_size] = (args, llm)
        return llm


def _alive(llm) -> bool:
    tp = getattr(llm.llm_engine, "_tp", None)
    return tp is None or tp.is_alive


def close_engines() -> None:
    """Shut down every engine :func:`tp_engine` keeps (stops the worker processes)."""
    with _ENGINES_LOCK:
        for _, llm in _ENGINES.values():
            llm.shutdown()
        _ENGINES.clear()


def _threads_per_rank(n: int) -> int:
    import os

    return max(1, (os.cpu_count() or 1) // n)


def tp_run(tensor_parallel_size: int, records, threads: int | None = None, **engine_args):
    """One real run of ``records`` on :func:`tp_engine`'s engine at this size.

    Args:
        threads: torch threads of this process during the run (``None``: leave them); the TP
            workers keep their own (``cores // tensor_parallel_size``, at least 1).
    """
    import torch

    llm = tp_engine(tensor_parallel_size, **engine_args)
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return lab_run(records, llm=llm)
    finally:
        torch.set_num_threads(saved)


def model_dims(llm) -> dict[str, int]:
    """``{"hidden_size", "num_hidden_layers", "dtype_bytes"}`` of a running engine's model."""
    eng = llm.llm_engine
    cfg = eng.hf_config
    import torch

    elem = torch.empty((), dtype=eng.config.torch_dtype).element_size()
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers, "dtype_bytes": elem}
