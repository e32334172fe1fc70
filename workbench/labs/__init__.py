"""The course labs' library: what the chapter notebooks in ``labs/`` call.

- :mod:`workbench.labs.runs` — real engine runs on a seeded trace, deterministic summaries;
- :mod:`workbench.labs.panel` — :class:`RunPanel`, widgets named like the engine arguments with a
  Run button and a live plot (``workbench[lab]``);
- :mod:`workbench.labs.exercise_registry` — self-checking exercises (:func:`check`), solutions verified;
  each chapter's exercises sit at the end of its module;
- :mod:`workbench.labs.ch01_kv_cache_anatomy` … :mod:`workbench.labs.ch06_sharing_and_preemption` — chapters 1-6:
  each chapter's measurements, tables and figures;
- :mod:`workbench.labs.ch07_parameter_matrix` — chapter 7: the parameter matrix (:class:`~workbench.labs.ch07_parameter_matrix.SweepPanel`,
  real and simulated sweeps, heatmaps);
- :mod:`workbench.labs.ch08_chunked_prefill` — chapter 8: chunked prefill and the ITL / TTFT trade-off;
- :mod:`workbench.labs.ch09_tensor_parallelism` — chapter 9: tensor parallelism, real and simulated;
- :mod:`workbench.labs.ch10_nccl_buffers` — chapter 10: NCCL buffers, KV blocks and throughput
- :mod:`workbench.labs.ch11_load_balancing` — chapter 11: replicas behind vLLM's router, policies measured per
  replica, a replica lost, data-parallel layouts in the simulator
  (what both share: :mod:`workbench.labs.multigpu_common`);
- :mod:`workbench.labs.ch13_eviction_policies` — chapter 13: eviction policies for shared prefixes (real and simulated runs
  per policy, the free queue, :class:`~workbench.labs.ch13_eviction_policies.EvictionPanel`; a notebook's own policy class
  registered by :func:`workbench.plugins.register_class`);
- :mod:`workbench.labs.ch14_defragmentation` — chapter 14: KV defragmentation by block copies, cost against benefit;
- :mod:`workbench.labs.ch15_memory_beside_kv` — chapter 15: memory beside the KV cache on every rank (measured on
  a TP=3 engine, modelled for 4-8 GPUs, a slider panel);
- :mod:`workbench.labs.ch16_case_study` — chapter 16: the 70B case study replayed in the simulator, hypothesis by hypothesis;
- :mod:`workbench.labs.ch17_load_testing` — chapter 17: load testing a real ``workbench serve`` with ``bench serve``;
- :mod:`workbench.labs.ch18_monitoring_and_alerting` — chapter 18: a real Prometheus scraping the server, alerts, the alert-to-action loop;
- :mod:`workbench.labs.ch19_regression_baseline` — chapter 19: a performance regression baseline and ``bench compare``;
- :mod:`workbench.labs.ch12_your_own_allocator` — chapter 12: your own allocator (a skeleton's reference solution, buggy
  variants, the scheduler's call trace, side-by-side runs); :func:`register_allocator` plugs a class defined in a
  notebook cell in by name.

The chapter modules are loaded on first use (``labs.ch07_parameter_matrix`` works after ``from workbench import labs``).
"""

from workbench.labs.exercise_registry import EXERCISES, check, solution
from workbench.labs.runs import LAB_ENGINE_DEFAULTS, breakdown_rows, breakdown_table, lab_run, lab_trace, run_summary

__all__ = [
    "EXERCISES",
    "LAB_ENGINE_DEFAULTS",
    "RunPanel",
    "breakdown_rows",
    "breakdown_table",
    "check",
    "lab_run",
    "lab_trace",
    "register_allocator",
    "run_summary",
    "solution",
]


#: chapter modules, imported on first use (they import plotly, widgets, the simulator)
_MODULES = (
    "ch01_kv_cache_anatomy",
    "ch02_fragmentation_live",
    "ch03_probes_and_logs",
    "ch04_paged_attention_inside",
    "ch05_batching_strategies",
    "ch06_sharing_and_preemption",
    "ch16_case_study",
    "ch08_chunked_prefill",
    "ch13_eviction_policies",
    "ch17_load_testing",
    "ch18_monitoring_and_alerting",
    "ch14_defragmentation",
    "multigpu_common",
    "ch10_nccl_buffers",
    "ch11_load_balancing",
    "ch12_your_own_allocator",
    "panel",
    "ch15_memory_beside_kv",
    "ch19_regression_baseline",
    "ch07_parameter_matrix",
    "ch09_tensor_parallelism",
)


def __getattr__(name):  # the panel imports ipywidgets: only when asked for
    if name == "RunPanel":
        from workbench.labs.panel import RunPanel

        return RunPanel
    if name == "register_allocator":  # chapter 12's: a notebook's KVManager class, loadable by name
        from workbench.labs.ch12_your_own_allocator import register_allocator

        return register_allocator
    if name in _MODULES:
        import importlib

        return importlib.import_module(f"workbench.labs.{name}")
    raise AttributeError(f"module 'workbench.labs' has no attribute {name!r}")


def setup(quiet: bool = True) -> None:
    """Prepare a notebook: plotly renders in JupyterLab and in nbconvert/nbval, the engine's and
    transformers' logs stay quiet (``quiet``), and the bundled model is converted once so that
    the chapter's first run does not pay for it."""
    import logging

    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype"  # JupyterLab draws it; no CDN, no iframe
    if quiet:
        logging.getLogger("workbench").setLevel(logging.WARNING)
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
        except ImportError:
            pass
    from workbench.config import EngineConfig
    from workbench.model.loader import load_model

    cfg = EngineConfig()
    load_model(cfg.model, cfg.resolved_cache_dir, cfg.tokenizer)
