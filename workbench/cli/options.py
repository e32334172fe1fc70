"""Click options generated from :class:`~workbench.config.EngineConfig`'s fields (CLI layer).

Each field's metadata (:func:`workbench.config.arg`) gives the option: ``--block-size`` from
``block_size``, its default, help and choices; a bool becomes ``--x/--no-x``; ``cli={"type": "bytes"}``
takes a size (``2GiB``) converted here; ``cli={"aliases": ("-tp",)}`` adds short names; ``cli=False``
leaves the field off the command line. ``workbench run``, ``compare`` and ``simulate`` use
:func:`engine_options`; a new engine argument is one field in ``config.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import click

from workbench.config import EngineConfig
from workbench.plugins import is_plugin_name
from workbench.units import parse_size

__all__ = ["VLLM_DEFAULTS", "parse_bytes", "dataclass_options", "engine_options", "engine_args", "bytes_fields"]

#: Engine arguments whose default is not vLLM 0.32's: vLLM's default and why ours differs, shown in ``--help``
#: after the option's own text (the docs' list: docs/serving.md, "Where the defaults differ from vLLM's").
VLLM_DEFAULTS: dict[str, str] = {
    "gpu_memory_utilization": "vLLM 0.32: 0.92. 0.9 here: vLLM's default before, and the value the course's GPU "
    "figures use",
    "max_num_seqs": "vLLM 0.32: 128 (CPU server), 256 (CPU LLM, GPUs under 70 GiB), 1024 (H100-class). 64 here, "
    "sized for the course's small pools; pass 128 for vLLM's CPU server",
    "max_model_len": "vLLM: the model's full context. Capped at 4096 here: the course's prompts are short, and "
    "the cap keeps one request's worst case within a laptop's default pool",
    "enable_prefix_caching": "vLLM 0.32: on. Off here, because the course measures the pool without sharing first "
    "and turns it on in chapter 6; without it vLLM's dashboard shows no prefix-cache hit rate",
    "max_num_batched_tokens": "vLLM 0.32 on CPU: 2048 for the server, 4096 for LLM; GPUs 8192-16384",
}


def parse_bytes(value: str | int | None) -> int | None:
    """``"2GiB"``, ``"1.5G"``, ``"512MiB"`` or a plain integer -> bytes (:func:`workbench.units.parse_size`);
    ``None`` stays ``None``.

    Raises:
        click.BadParameter: not a size (naming the value and the accepted forms).
    """
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        return parse_size(value, allow_zero=True)  # zero and range are EngineConfig.validate's to refuse
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _bytes_callback(ctx: click.Context, param: click.Parameter, value):
    return parse_bytes(value)


def _kind(annotation) -> str:
    """``"int"``, ``"float"``, ``"bool"``, ``"str"``... of a field's annotation (``"int | None"`` -> ``"int"``)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    kinds = [t.strip() for t in text.replace("Optional[", "").rstrip("]").split("|") if t.strip() != "None"]
    return kinds[0] if kinds else "str"


def _cli(f: dataclasses.Field) -> dict | None:
    """The field's ``cli`` metadata as a dict, or ``None`` when the field has no option."""
    cli = f.metadata.get("cli", True)
    if f.metadata.get("internal") or cli is False:
        return None
    return {} if cli is True else dict(cli)


class _ChoiceOrPlugin(click.Choice):
    """One of the choices, or a plug-in ``package.module:ClassName``."""

    def convert(self, value, param, ctx):
        if is_plugin_name(value):
            return value
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            names = ", ".join(map(repr, self.choices))
            self.fail(f"{value!r} is not one of {names}, nor a plug-in 'package.module:ClassName'", param, ctx)

    def get_metavar(self, param, *args, **kwargs) -> str:
        return "[" + "|".join(self.choices) + "|MODULE:CLASS]"


def _option(f: dataclasses.Field, cli: dict):
    flag = "--" + f.name.replace("_", "-")
    default = f.default if f.default is not dataclasses.MISSING else None
    kind = _kind(f.type)
    kw = {"default": default, "help": f.metadata.get("help")}
    if f.name in VLLM_DEFAULTS:
        kw["help"] = f"{kw['help']}. {VLLM_DEFAULTS[f.name]}"
    if default is not None:
        kw["show_default"] = True
    choices = f.metadata.get("choices")
    if kind == "bool":
        decls = [f"{flag}/--no-{flag[2:]}"]
    else:
        decls = [flag, *cli.get("aliases", ())]
        if choices and cli.get("plugins"):
            kw["type"] = _ChoiceOrPlugin(list(choices))
        elif choices:
            kw["type"] = click.Choice(list(choices))
        elif cli.get("type") == "bytes":
            kw["callback"] = _bytes_callback  # the value stays text for click (its help shows TEXT)
        elif kind in ("int", "float"):
            kw["type"] = int if kind == "int" else float
    return click.option(*decls, f.name, **kw)


def dataclass_options(cls, exclude: Iterable[str] = ()) -> list:
    """The click options (decorators, in field order) of dataclass ``cls``'s fields, less ``exclude``."""
    exclude = set(exclude)
    return [_option(f, cli) for f in dataclasses.fields(cls) if f.name not in exclude and (cli := _cli(f)) is not None]


def engine_options(f=None, *, exclude: tuple[str, ...] = (), config_cls=EngineConfig):
    """Every engine argument as a flag, named as in vLLM (less the ``exclude``d ones).

    Use as ``@engine_options`` or ``@engine_options(exclude=("kv_allocator",))``.
    """
    if f is None:
        return lambda g: engine_options(g, exclude=exclude, config_cls=config_cls)
    for o in reversed(dataclass_options(config_cls, exclude)):
        f = o(f)
    return f


def bytes_fields(cls=EngineConfig) -> tuple[str, ...]:
    """Names of the fields given as sizes on the command line (``cli={"type": "bytes"}``)."""
    return tuple(f.name for f in dataclasses.fields(cls) if (_cli(f) or {}).get("type") == "bytes")


def engine_args(kw: dict, cls=EngineConfig) -> dict:
    """The engine arguments among a command's keyword arguments, sizes converted to bytes."""
    keys = {f.name for f in dataclasses.fields(cls)}
    args = {k: v for k, v in kw.items() if k in keys}
    for name in bytes_fields(cls):
        if name in args:
            args[name] = parse_bytes(args[name])
    return args


# ---------------------------------------------------------------- what `run` and `simulate` print
def kv_manager_line(cfg: dict) -> str:
    """The run's KV manager in one line, from its engine arguments (:meth:`EngineConfig.to_dict`): allocator and
    block size, prefix caching and its eviction policy, the compaction trigger and its threshold (the default one
    when none was given)."""
    from workbench.kv.defrag import DEFAULT_THRESHOLDS

    parts = [f"{cfg.get('kv_allocator')}, block_size {cfg.get('block_size')}"]
    if cfg.get("enable_prefix_caching"):
        parts.append(f"prefix caching (eviction {cfg.get('prefix_cache_eviction')})")
    trigger = cfg.get("kv_defrag_trigger", "none")
    if trigger != "none":
        th = cfg.get("kv_defrag_threshold")
        th = DEFAULT_THRESHOLDS.get(trigger) if th is None else th
        parts.append(f"compaction: {trigger}" + ("" if th is None else f" > {th:g}"))
    return "; ".join(parts)


def kv_figure_rows(s: dict, cfg: dict | None = None) -> list[tuple[str, str]]:
    """``(label, value)`` rows of a run summary's prefix-cache and compaction figures
    (:func:`workbench.metrics.stats.prefix_cache_summary`, :func:`workbench.viz.report.summary_table`): those it has,
    and, given the run's engine arguments ``cfg``, those its features make expected even at zero (no evictions,
    a trigger that never fired), so "ran and did nothing" reads differently from "off"."""
    cfg = cfg or {}
    caching, trigger = cfg.get("enable_prefix_caching"), cfg.get("kv_defrag_trigger", "none")
    rows = []
    queries, hits = s.get("prefix_cache_queries_total") or 0, s.get("prefix_cache_hits_total") or 0
    if queries:
        rows.append(("prefix-cache hit rate (prompt tokens)", f"{hits / queries:.1%} ({hits:,} of {queries:,})"))
    if s.get("prefix_cache_evictions_total"):
        age = s["evicted_block_age_mean_steps"], s["evicted_block_age_p50_steps"]
        rows.append(
            (
                "prefix-cache evictions; evicted block age mean / median",
                f"{s['prefix_cache_evictions_total']:,} blocks, {age[0]:,.1f} / {age[1]:,.1f} steps",
            )
        )
    elif caching:
        rows.append(("prefix-cache evictions", "0 (the cache never had to give a block back)"))
    if s.get("defrag_passes"):
        rows.append(
            (
                "KV compaction: passes, blocks moved, copy time; requests unblocked",
                f"{s['defrag_passes']:,}, {s['defrag_blocks_moved']:,} ({s['defrag_bytes_moved'] / 2**20:,.1f} MiB), "
                f"{s['defrag_copy_time_s'] * 1e3:,.1f} ms; {s['defrag_unblocked_reqs']:,}",
            )
        )
    elif trigger != "none":
        rows.append(("KV compaction passes", f"0 (the {trigger} trigger never fired)"))
    return rows
