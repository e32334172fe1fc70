"""Chapter 15's library (workbench.labs.ch15_memory_beside_kv): the custom all-reduce model, one rank's memory on a
real TP engine, the modelled GPU breakdown against the simulated engine's own budget, and the panel."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from lab_contexts.ch14 import EX_14_1
from lab_contexts.ch15 import EX_15_1

from workbench import labs
from workbench.comm import CUSTOM_AR_MAX_SIZE, custom_all_reduce_bytes, nccl_buffer_bytes
from workbench.labs import ch09_tensor_parallelism as tpl
from workbench.labs import ch10_nccl_buffers as ncb
from workbench.labs import ch15_memory_beside_kv as rm

MiB = 1 << 20


def test_custom_all_reduce_model_follows_vllms_rules():
    e = custom_all_reduce_bytes(8)
    assert e.enabled and e.max_size == 8 * MiB
    assert (e.meta_bytes, e.buffer_bytes, e.rank_data_bytes) == (2560 + 8 * MiB, 8 * MiB, 8 * MiB)
    assert e.per_rank_bytes == 24 * MiB + 2560
    for n, nvlink, why in ((1, True, "one rank"), (3, True, "unsupported world size 3"), (4, False, "PCIe-only")):
        off = custom_all_reduce_bytes(n, fully_connected=nvlink)
        assert not off.enabled and off.per_rank_bytes == 0 and why in off.reason
    assert custom_all_reduce_bytes(2, fully_connected=False).enabled  # two PCIe GPUs: still on
    assert custom_all_reduce_bytes(8, disabled=True).per_rank_bytes == 0
    assert custom_all_reduce_bytes(4, max_size=MiB).per_rank_bytes == 2 * MiB + 2560 + 8 * MiB
    for bad in (0, 17, 2.5):
        with pytest.raises(ValueError, match="multiple of 16 bytes"):
            custom_all_reduce_bytes(4, max_size=bad)


def test_the_simulator_counts_the_custom_all_reduce_with_the_buffers():
    on = ncb.sim_budget("llama-2-70b", "H100-80GB", 8, spec={"custom_all_reduce": True})
    off = ncb.sim_budget("llama-2-70b", "H100-80GB", 8)
    assert on.comm_buffer_bytes - off.comm_buffer_bytes == custom_all_reduce_bytes(8).per_rank_bytes
    assert off.comm_buffer_bytes == nccl_buffer_bytes(8).per_rank_bytes
    assert on.num_blocks < off.num_blocks
    # an L4 (PCIe) group of 4: vLLM would not build one, so nothing is counted
    pcie = ncb.sim_budget("llama-2-13b", "L4", 4, spec={"custom_all_reduce": True})
    assert pcie.comm_buffer_bytes == nccl_buffer_bytes(4).per_rank_bytes


def test_gpu_rank_rows_add_up_and_buy_back_what_they_free():
    r = rm.gpu_rank_rows("llama-2-70b", "H100-80GB", 8)
    assert sum(b for _, b in r["parts"]) == r["capacity_bytes"]
    parts = dict(r["parts"])
    assert parts["custom all-reduce"] == custom_all_reduce_bytes(8).per_rank_bytes
    assert parts["CUDA graph pool (in the budget)"] == rm.cuda_graph_pool_bytes() > 0
    assert r["num_blocks"] == r["memory"].num_blocks and r["headroom_free"] == r["headroom_bytes"]
    # the pool captured after the KV cache: more blocks, the headroom holds the graphs
    late = rm.gpu_rank_rows("llama-2-70b", "H100-80GB", 8, graphs_in_budget=False, slack_bytes=512 * MiB)
    assert late["num_blocks"] > r["num_blocks"]
    assert late["headroom_free"] == late["headroom_bytes"] - rm.cuda_graph_pool_bytes() - 512 * MiB
    rows = {(x["tensor_parallel_size"], x["choice"]): x for x in rm.buyback_rows(sizes=(4, 8))}
    for tp in (4, 8):
        base = rows[(tp, "vLLM-like defaults")]
        assert base["blocks_bought"] == 0
        for name in ("disable_custom_all_reduce", "NCCL 1 MiB, Simple only", "enforce_eager (no graphs)"):
            x = rows[(tp, name)]
            lo = x["freed_bytes"] // x["block_bytes"]
            assert x["freed_bytes"] > 0 and lo <= x["blocks_bought"] <= lo + 1  # whole blocks of two budgets
        assert (
            rows[(tp, "gpu_memory_utilization 0.95")]["blocks_bought"]
            > rows[(tp, "buffers and graphs off")]["blocks_bought"]
        )
    assert len(rm.gpu_rank_figure([r, late]).data) >= 7
    with pytest.raises(ValueError, match="unknown choice"):
        rm.rank_choices(custom_allreduce=False)
    with pytest.raises(ValueError, match="capture_size=-1"):
        rm.cuda_graph_pool_bytes(capture_size=-1)


def test_exercise_14_1_context_is_the_engines_budget():
    ex = rm.custom_ar_exercise()
    assert ex == EX_15_1  # the test context is the simulated engine's figure, not a copy gone stale
    assert labs.solution("15.1", **ex) == ex["engine_num_blocks"] - ex["budget"]["num_blocks"]


def test_sim_buyback_grid_frees_blocks_and_not_more():
    rows = rm.sim_buyback_grid(setups=(("A100-80GB", 4),), num_requests=64)
    by = {r["choice"]: r for r in rows}
    d, off = by["vLLM-like defaults"], by["buffers and graphs off"]
    assert off["num_blocks"] > d["num_blocks"] and off["peak_running"] >= d["peak_running"]
    assert rm.sim_buyback_table(rows).rows


@pytest.mark.slow
def test_measured_rank_memory_on_a_tiny_tp_engine(tiny_model):
    args = dict(model=str(tiny_model), max_model_len=128, max_num_seqs=4, device_memory=64 * MiB)
    try:
        llm = tpl.tp_engine(2, **args)
        parts = {r["part"]: r["bytes"] for r in rm.rank_budget_rows(llm)}
        m = llm.llm_engine.memory
        assert parts["KV pool (whole blocks)"] == m.kv_pool_bytes and parts["custom all-reduce"] == 24 * MiB + 2560
        assert sum(v for k, v in parts.items() if not k.startswith("capacity") and k != "custom all-reduce") == (
            m.capacity_bytes
        )
        ws = rm.workspace_rows(llm, (16, 64))
        assert [w["max_num_batched_tokens"] for w in ws][:2] == [16, 64]
        own = next(w for w in ws if w["engine"])
        assert own["blocks_change"] == 0 and own["activation_bytes"] > 0
        assert ws[0]["activation_bytes"] < ws[1]["activation_bytes"] and ws[0]["num_blocks"] >= ws[1]["num_blocks"]
        trace = labs.lab_trace(2, mean_output=2, max_output=3)
        records = [
            r.__class__(list(range(3, 11 + 5 * i)), False, r.id, r.max_tokens, r.output_len)
            for i, r in enumerate(trace)
        ]
        run = tpl.tp_run(2, records, **args)
        dims = tpl.model_dims(llm)
        msgs = rm.message_rows(run, dims)
        assert msgs and all(x["message_bytes"] == x["tokens"] * 64 * 4 and x["custom_ar"] for x in msgs)
        assert not rm.message_rows(run, dims, max_size=16)[0]["custom_ar"]
        procs = rm.process_memory_rows(llm)
        assert [p["rank"] for p in procs] == [0, 1]
        assert rm.message_table(msgs, dims).rows and rm.process_memory_table(procs).rows
    finally:
        tpl.close_engines()
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()
    assert CUSTOM_AR_MAX_SIZE == 8 * MiB


def test_rank_memory_panel_runs_and_names_bad_values():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    p = rm.RankMemoryPanel()
    r = p.run()
    assert r["blocks_bought"] == 0 and "vs the vLLM-like defaults" in p.status_text
    r = p.run(disable_custom_all_reduce=True, enforce_eager=True)
    assert r["blocks_bought"] > 0 and len(p.figure.data[0].x) == 2
    r = p.run(graphs_in_budget=False, gpu_memory_utilization=0.98, allocator_slack_mib=2048)
    assert r["headroom_free"] < 0 and "short" in p.status_text
    with pytest.raises(ValueError, match="nccl_buffsize_mib=0"):
        p.run(nccl_buffsize_mib=0)
    assert "nccl_buffsize_mib" in p.status.value


# ---------------------------------------------------------------- chapter 14: defragmentation
def test_exercise_13_1_context_and_plan():
    from workbench.labs import ch14_defragmentation as cp

    assert cp.EXERCISE_14_1 == EX_14_1
    assert labs.solution("14.1", **EX_14_1) == 7
    snap = cp.regions_map(EX_14_1["regions"], 24, 5)
    assert cp.regions_of(snap) == [tuple(r) for r in EX_14_1["regions"]]
    assert snap["state"].count("external") == 10  # every hole holds 2 blocks, fewer than 5


def test_compaction_on_a_tiny_engine_records_passes_and_maps(tiny_model):
    from workbench.labs import ch14_defragmentation as cp

    records = [
        r.__class__(list(range(3, 3 + 20 + 7 * (i % 3))), False, r.id, n, n)
        for i, (r, n) in enumerate(zip(labs.lab_trace(8), (2, 9, 3, 12, 4, 2, 8, 5)))
    ]
    args = dict(model=str(tiny_model), max_model_len=128, num_gpu_blocks_override=12, records=records)
    none = cp.defrag_run("orca-max", "none", **args)
    wait = cp.defrag_run("orca-max", "waiting", **args)
    rows = cp.trigger_rows([none, wait])
    assert rows[0]["passes"] == 0 and rows[1]["passes"] == len(wait.passes)
    assert all(r["finished"] == 8 for r in rows)
    assert wait.result.recorder.steps[0].step == 0  # set_trigger restarts the step count
    for rec in wait.passes:
        assert rec["pass"].blocks_moved == len(rec["moves"]) and rec["before"] and rec["after"]
    if any(r["pass"].unblocked for r in wait.passes):
        st = cp.story(wait)
        assert st["admitted"] and cp.moves_table(st).rows
    paged = cp.defrag_run("paged", "highest-block", 0, **args)
    tail = cp.tail_rows([paged])[0]
    assert tail["steps_external"] == 0 and tail["min_tail"] >= 0
    assert len(cp.highest_block_figure([paged]).data) == 2
    with pytest.raises(ValueError, match="kv_defrag_threshold"):
        cp.set_trigger(cp.lab_engine("paged", 12, model=str(tiny_model), max_model_len=128), "fragmentation", 3)
