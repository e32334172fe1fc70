"""What chapters 9 and 10 of the labs share: the simulator runs (:func:`sim_run_row` prices a
Megatron-style split of a catalogue model on named GPUs with NVLink or PCIe links, :mod:`workbench.sim`)
and the base of their panels (widgets named like the engine arguments, a Run button, a plot).

The chapters' own code is in :mod:`workbench.labs.ch09_tensor_parallelism` (chapter 9) and
:mod:`workbench.labs.ch10_nccl_buffers` (chapter 10); both re-export what they use from here.
"""

from __future__ import annotations

import html
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from workbench.labs.panel import RunButtonThread, _accepts

MiB = 1 << 20

__all__ = ["MiB", "PCIE_GEN4_LINK", "burst_trace", "sim_hardware", "sim_run_row", "sim_table"]


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
            self.status_text = self.error or ""  # the plain-text status follows the widget's: the error, not the last run
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
