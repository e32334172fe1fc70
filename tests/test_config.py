"""Every bad engine argument gets a ValueError naming the value and the fix, before any model loads."""

from __future__ import annotations

import pytest

from workbench import LLM, SamplingParams
from workbench.config import EngineConfig


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"block_size": 12}, ["block_size=12", "power of two"]),
        ({"block_size": 0}, ["block_size=0", "power of two"]),
        ({"gpu_memory_utilization": 0.0}, ["gpu_memory_utilization=0.0", "(0, 1]"]),
        ({"gpu_memory_utilization": 1.5}, ["gpu_memory_utilization=1.5", "(0, 1]"]),
        ({"max_num_seqs": 0}, ["max_num_seqs=0", ">= 1"]),
        (
            {"max_num_seqs": 64, "max_num_batched_tokens": 32},
            ["max_num_batched_tokens=32", "max_num_seqs=64", "at least 64"],
        ),
        ({"dtype": "int3"}, ["dtype='int3'", "float32"]),
        ({"device_memory": -5}, ["device_memory=-5"]),
        ({"long_prefill_token_threshold": -1}, ["long_prefill_token_threshold=-1"]),
    ],
)
def test_bad_engine_arguments(kwargs, words):
    with pytest.raises(ValueError) as e:
        EngineConfig(**kwargs).validate()
    for w in words:
        assert w in str(e.value)


def test_missing_model_path_fails_before_loading(tmp_path, monkeypatch):
    import workbench.executor.local as executor_local

    def boom(*a, **k):  # the model must not start loading
        raise AssertionError("load_model was called")

    monkeypatch.setattr(executor_local, "load_model", boom)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="block_size=3"):
        LLM(model=str(tmp_path), block_size=3)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(model=str(tmp_path), blocksize=16)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n=0"),
    ],
)
def test_bad_sampling_params(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.slow
def test_swap_without_swap_space_and_priority_without_policy_are_errors(tiny_model):
    with pytest.raises(ValueError, match="swap_space > 0"):
        EngineConfig(preemption_mode="swap", swap_space=0).validate()
    llm = LLM(model=str(tiny_model), max_model_len=128)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[1])
    assert not llm.llm_engine.has_unfinished_requests()
