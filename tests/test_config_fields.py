"""One source for every engine argument: EngineConfig's fields generate the CLI options, the lab panels'
name check and the run folder's config.json; the choices are declared once; the layers have no cycles."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from workbench.cli.main import main
from workbench.cli.options import dataclass_options, engine_args, engine_options, parse_bytes
from workbench.config import (
    ATTENTION_BACKENDS,
    BATCHING_POLICIES,
    CONTIGUOUS_ALLOCATORS,
    KV_ALLOCATORS,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    EngineConfig,
    arg,
    engine_arg_names,
)

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
ON_CLI = [f for f in FIELDS.values() if not f.metadata.get("internal") and f.metadata.get("cli", True) is not False]


def _params(command: str) -> dict[str, click.Parameter]:
    return {p.name: p for p in main.commands[command].params}


def test_every_engine_field_is_an_option_of_run_with_its_default_and_choices():
    params = _params("run")
    assert ON_CLI and {f.name for f in ON_CLI} <= set(params)
    for f in ON_CLI:
        p = params[f.name]
        assert p.default == f.default, f.name
        assert p.help.startswith(f.metadata["help"]), f.name  # then vLLM's default, where ours differs
        choices = f.metadata.get("choices")
        if choices:
            assert isinstance(p.type, click.Choice) and list(p.type.choices) == list(choices), f.name
        if f.type == "bool":
            assert p.is_flag and p.secondary_opts == ["--no-" + f.name.replace("_", "-")]
    # the options off the CLI are declared so: extra (internal) and cache_dir (cli=False)
    assert set(FIELDS) - {f.name for f in ON_CLI} == {"extra", "cache_dir"}
    help_text = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    for f in ON_CLI:
        assert "--" + f.name.replace("_", "-") in help_text


def test_compare_and_simulate_take_the_generated_options_less_their_exclusions():
    compare = _params("compare")
    assert "kv_allocator" not in compare and "batching_policy" not in compare  # compare takes lists of them
    assert compare["allocators"].default == ",".join(("paged", *CONTIGUOUS_ALLOCATORS))  # the paper's Fig. 2 five
    assert compare["policies"].default == BATCHING_POLICIES[0]
    assert {f.name for f in ON_CLI} - {"kv_allocator", "batching_policy"} <= set(compare)
    sim = _params("simulate")
    for name in ("max_num_seqs", "gpu_memory_utilization", "enable_prefix_caching", "kv_allocator"):
        assert sim[name].default == FIELDS[name].default
    assert sim["tensor_parallel_size"].default == 4  # simulate's own option, not the engine's
    assert "device_memory" not in sim and "attention_backend" not in sim


def test_short_alias_and_byte_sizes_and_bool_flags_still_work():
    seen = {}

    @click.command()
    @engine_options
    def cmd(**kw):
        seen.update(engine_args(kw))

    res = CliRunner().invoke(
        cmd,
        ["-tp", "2", "--device-memory", "2GiB", "--kv-cache-memory-bytes", "256MiB", "--nccl-buffsize", "1048576"]
        + ["--enable-prefix-caching", "--no-enable-chunked-prefill", "--kv-allocator", "static"],
    )
    assert res.exit_code == 0, res.output
    assert seen["tensor_parallel_size"] == 2
    assert (seen["device_memory"], seen["kv_cache_memory_bytes"], seen["nccl_buffsize"]) == (
        2 << 30,
        256 << 20,
        1 << 20,
    )
    assert seen["enable_prefix_caching"] is True and seen["enable_chunked_prefill"] is False
    assert set(seen) == {f.name for f in ON_CLI}
    bad = CliRunner().invoke(cmd, ["--device-memory", "lots"])
    assert bad.exit_code == 2 and "--device-memory" in bad.output and "'lots' is not a memory size" in bad.output
    bad = CliRunner().invoke(cmd, ["--kv-allocator", "slab"])
    assert bad.exit_code == 2 and "orca-oracle" in bad.output


def test_a_new_field_is_one_declaration_and_then_an_option():
    @dataclasses.dataclass
    class Cfg(EngineConfig):
        my_knob: int = arg(3, "a new knob")
        my_mode: str = arg("a", "a mode", choices=("a", "b"))
        my_pool: int | None = arg(None, "a pool size", cli={"type": "bytes"})
        my_flag: bool = arg(False, "a flag")
        hidden: str | None = arg(None, "not on the CLI", cli=False)

    opts = {}
    for o in dataclass_options(Cfg):
        p = o(lambda: None).__click_params__[0]
        opts[p.name] = p
    assert opts["my_knob"].default == 3 and opts["my_knob"].type is click.INT and opts["my_knob"].help == "a new knob"
    assert list(opts["my_mode"].type.choices) == ["a", "b"]
    assert opts["my_flag"].opts == ["--my-flag"] and opts["my_flag"].secondary_opts == ["--no-my-flag"]
    assert "hidden" not in opts and "extra" not in opts and "model" in opts

    seen = {}

    @click.command()
    @engine_options(config_cls=Cfg, exclude=("model",))
    def cmd(**kw):
        seen.update(engine_args(kw, Cfg))

    res = CliRunner().invoke(cmd, ["--my-knob", "7", "--my-mode", "b", "--my-pool", "1KiB", "--my-flag"])
    assert res.exit_code == 0, res.output
    assert (seen["my_knob"], seen["my_mode"], seen["my_pool"], seen["my_flag"]) == (7, "b", 1024, True)
    assert "model" not in seen
    with pytest.raises(ValueError, match="my_mode='c' must be one of 'a', 'b'"):
        Cfg(my_mode="c").validate()


def test_lab_name_check_uses_the_engine_fields():
    from workbench.labs.runs import check_engine_arg_names

    assert set(engine_arg_names()) == set(FIELDS) - {"extra"}
    check_engine_arg_names(engine_arg_names())  # every field is a valid name
    with pytest.raises(ValueError, match="did you mean 'block_size'"):
        check_engine_arg_names(["blok_size"])
    with pytest.raises(ValueError) as e:
        check_engine_arg_names(["zzzzzzzz"])
    listed = str(e.value).split("engine arguments: ")[1].split(", ")
    assert set(listed) == set(engine_arg_names())
    with pytest.raises(ValueError):
        check_engine_arg_names(["extra"])


def test_config_json_holds_exactly_the_engine_fields():
    cfg = EngineConfig(block_size=32, extra={"x": 1})
    d = cfg.to_dict()
    assert list(d) == list(engine_arg_names())
    assert d["block_size"] == 32 and "extra" not in d
    assert EngineConfig(**d).to_dict() == d  # round-trips


def test_run_folder_config_json_is_built_from_to_dict():
    """bench/run.py and sim/run.py write config.json from ``config.to_dict()`` plus resolved and job
    figures, not from a hand list of engine arguments."""
    for path in ("workbench/bench/run.py", "workbench/sim/run.py"):
        assert "config = eng.config.to_dict() |" in (ROOT / path).read_text(), path


@pytest.mark.parametrize(
    "field, choices, bad",
    [
        ("kv_allocator", KV_ALLOCATORS, "slab"),
        ("batching_policy", BATCHING_POLICIES, "dynamic"),
        ("preemption_mode", PREEMPTION_MODES, "drop"),
        ("scheduling_policy", SCHEDULING_POLICIES, "lifo"),
        ("attention_backend", ATTENTION_BACKENDS, "flash"),
    ],
)
def test_choices_are_declared_once_and_validated(field, choices, bad):
    assert FIELDS[field].metadata["choices"] == choices
    with pytest.raises(ValueError, match=f"{field}='{bad}' must be one of"):
        EngineConfig(**{field: bad}).validate()


def test_old_import_sites_see_the_same_tuples():
    from workbench.attention.backend import BACKEND_NAMES
    from workbench.config import BUILTIN_ALLOCATORS
    from workbench.kv.contiguous import CONTIGUOUS_ALLOCATORS
    from workbench.kv.contiguous import KV_ALLOCATORS as KVA
    from workbench.scheduler import BATCHING_POLICIES as BP

    assert BACKEND_NAMES is ATTENTION_BACKENDS and KVA is KV_ALLOCATORS and BP is BATCHING_POLICIES
    assert KV_ALLOCATORS == ("paged", *CONTIGUOUS_ALLOCATORS, *BUILTIN_ALLOCATORS)
    assert list(BUILTIN_ALLOCATORS) == ["best-fit", "buddy"]


def test_one_size_parser():
    from workbench.kvcalc import parse_size as kvcalc_parse_size
    from workbench.units import parse_size

    assert kvcalc_parse_size is parse_size
    assert parse_bytes("1.5G") == parse_size("1.5G") == 1_500_000_000
    assert parse_bytes("2TB") == 2 * 10**12 and parse_bytes("24e9") == 24 * 10**9
    assert parse_bytes(None) is None and parse_bytes(7) == 7
    with pytest.raises(ValueError, match=r"'lots' is not a memory size; write e\.g\. 80GiB"):
        parse_size("lots")
    with pytest.raises(click.BadParameter, match="'lots' is not a memory size"):
        parse_bytes("lots")


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return set(out.split())


@pytest.mark.slow
def test_kvcalc_is_the_calculator_only():
    mods = _modules_after("import workbench.kvcalc")
    assert not {m for m in mods if m.split(".")[0] in ("click", "rich")}


@pytest.mark.slow
def test_no_cycle_between_the_clis():
    mods = _modules_after("import workbench.cli.simulate")
    assert "workbench.cli.main" not in mods and "workbench.cli.options" in mods
