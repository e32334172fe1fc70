"""benchmarks/offline_throughput.py's FLOP count, matmul shapes and options, and vllm_cpu.py's failure path.

None of these install or run vLLM (that is the benchmark's own job, minutes long); the child's
failure path runs this interpreter, which has no vLLM, as the "venv" python.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import offline_throughput as ot  # noqa: E402
import vllm_cpu  # noqa: E402

SMOLLM2_135M = LlamaConfig(
    hidden_size=576,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    intermediate_size=1536,
    num_hidden_layers=30,
    vocab_size=49152,
)


def test_linear_shapes_of_smollm2():
    shapes = {s["name"]: (s["in"], s["out"], s["count"]) for s in ot.linear_shapes(SMOLLM2_135M)}
    assert shapes == {
        "qkv_proj": (576, 576 + 2 * 192, 30),
        "o_proj": (576, 576, 30),
        "gate_up_proj": (576, 2 * 1536, 30),
        "down_proj": (1536, 576, 30),
        "lm_head": (576, 49152, 1),
    }


def test_model_flops_by_hand():
    # two requests, prompts of 3 and 5 tokens, 4 tokens each: 3+3 and 5+3 processed tokens
    f = ot.model_flops(SMOLLM2_135M, [3, 5], 4)
    n_lin = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert f["linear_params"] == n_lin
    assert f["processed_tokens"] == 6 + 8
    assert f["sampled_tokens"] == 8
    assert f["linear"] == 2 * n_lin * 14
    assert f["lm_head"] == 2 * 576 * 49152 * 8
    # contexts 1..6 and 1..8
    assert f["attention"] == 2 * 2 * 30 * 9 * 64 * (21 + 36)
    assert f["total"] == f["linear"] + f["lm_head"] + f["attention"]


def test_matmul_rates_structure():
    tiny = LlamaConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=2, vocab_size=100,
    )  # fmt: skip
    m = ot.matmul_rates(tiny, [torch.float32, torch.bfloat16], [4, 16])
    assert set(m["rates"]) == {"float32", "bfloat16"}
    for per_m in m["rates"].values():
        assert set(per_m) == {"4", "16"}
        for r in per_m.values():
            assert r["forward_gflop_per_s"] > 0 and r["layers_gflop_per_s"] > 0
            assert set(r["shapes"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
            for sh in r["shapes"].values():  # the rate is the faster of the plain and the prepacked product
                assert sh["median_s"] == min(t for t in (sh["dense_median_s"], sh["packed_median_s"]) if t)
    assert all(sh["packed_median_s"] is None for r in m["rates"]["float32"].values() for sh in r["shapes"].values())


def test_systems_and_dtype_options():
    args = ot.parse_args([])
    assert args.systems == [
        "engine", "engine-torch-attn", "engine-eager-glue", "engine-no-chunk-kernel", "engine-rowwise-decode",
        "engine-dense-lm-head", "hf-static", "hf-cb", "vllm",
    ]  # fmt: skip
    assert args.dtype == "auto" and args.matmul_m == [64, 256, 2048]
    args = ot.parse_args(["--systems", "engine,hf-static,hf-cb", "--dtype", "bfloat16", "--matmul-m", "none"])
    assert args.systems == ["engine", "hf-static", "hf-cb"] and args.dtype == "bfloat16" and args.matmul_m == []
    with pytest.raises(SystemExit):
        ot.parse_args(["--dtype", "float16"])


def test_auto_dtype_is_the_engines():
    from workbench.config import EngineConfig

    assert ot.resolve_run_dtype("auto") == EngineConfig(dtype="auto").torch_dtype
    assert ot.resolve_run_dtype("bfloat16") == torch.bfloat16
    assert ot.dtype_name(torch.bfloat16) == "bfloat16"


def test_child_env_binds_the_threads():
    env = vllm_cpu.child_env(2)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["OMP_NUM_THREADS"] == "2"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == min(2, len(vllm_cpu.omp_bind_list(64).split(",")))
    assert vllm_cpu.child_env(2, "nobind")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.slow
def test_run_vllm_reports_a_failed_child(tmp_path):
    # this interpreter has no vLLM: the child fails on its import, and run_vllm says so instead of raising
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is importable here")
    except ImportError:
        pass
    job = {"model_folder": str(tmp_path), "prompts": [[1, 2]], "max_tokens": 2, "dtype": "float32"}
    res = vllm_cpu.run_vllm(Path(sys.executable), job, tmp_path, 1, timeout=120)
    assert res["ok"] is False
    assert "failed" in res["reason"] and "vllm" in res["reason"].lower()
    assert res["env"]["OMP_NUM_THREADS"] == "1"


def test_ensure_venv_reuses_a_working_venv(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_cpu, "_vllm_version", lambda py: ("0.32.0 2.13.0+cpu", ""))
    monkeypatch.setattr(vllm_cpu.subprocess, "run", lambda *a, **k: calls.append(a))
    py = vllm_cpu.venv_python(tmp_path)
    py.parent.mkdir(parents=True)
    py.touch()
    info = vllm_cpu.ensure_venv(tmp_path)
    assert info["ok"] and info["reused"] and not calls


def test_ensure_venv_failure_is_a_reason(tmp_path, monkeypatch):
    class Done:
        returncode = 1

    monkeypatch.setattr(vllm_cpu.subprocess, "run", lambda *a, **k: Done())
    info = vllm_cpu.ensure_venv(tmp_path / "venv", tmp_path / "install.log")
    assert info["ok"] is False and "create venv failed" in info["reason"]
