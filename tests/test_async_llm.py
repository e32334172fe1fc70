"""``AsyncLLM``: the engine on a background thread behind ``async generate``, as vLLM's."""

from __future__ import annotations

import asyncio

import pytest

from workbench import LLM, AsyncLLM, SamplingParams
from workbench.entrypoints.async_llm import EngineDeadError
from workbench.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

ENGINE = dict(max_model_len=256, max_num_seqs=8)
PROMPTS = ["The capital of France is", "List three fruits:", "Once upon a time"]


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(**ENGINE)
    yield eng
    eng.shutdown()


async def collect(eng, prompt, sp, rid):
    outs = [o async for o in eng.generate(prompt, sp, request_id=rid)]
    return outs


def test_deltas_add_up_to_the_offline_text(engine):
    with LLM(**ENGINE) as llm:
        want = [o.outputs[0] for o in llm.generate(PROMPTS, SamplingParams(max_tokens=20))]

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, SamplingParams(max_tokens=20), f"d{i}") for i, p in enumerate(PROMPTS))
        )

    for outs, w in zip(asyncio.run(main()), want):
        assert len(outs) > 1, "a DELTA request yields more than once"
        assert "".join(o.outputs[0].text for o in outs) == w.text
        assert sum((o.outputs[0].token_ids for o in outs), []) == w.token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].outputs[0].finish_reason == w.finish_reason


def test_final_only_and_cumulative(engine):
    async def main():
        final = await collect(
            engine, PROMPTS[0], SamplingParams(max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY), "f"
        )
        cum = await collect(
            engine, PROMPTS[0], SamplingParams(max_tokens=12, output_kind=RequestOutputKind.CUMULATIVE), "c"
        )
        return final, cum

    final, cum = asyncio.run(main())
    assert len(final) == 1 and final[0].finished
    texts = [o.outputs[0].text for o in cum]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == final[0].outputs[0].text


def test_leaving_early_aborts_and_frees_the_blocks(engine):
    async def main():
        n = 0
        async for _ in engine.generate(PROMPTS[1], SamplingParams(max_tokens=200, ignore_eos=True), request_id="early"):
            n += 1
            if n == 3:
                break
        for _ in range(100):
            idle = engine.call(lambda e: not e.has_unfinished_requests())
            if idle:
                break
            await asyncio.sleep(0.05)
        return engine.call(lambda e: (e.kv.num_free_blocks, e.kv.num_blocks, e.recorder.requests[-1]))

    free, total, record = asyncio.run(main())
    assert free == total
    assert record.request_id == "early" and record.finish_reason == "abort"


def test_bad_input_raises_before_anything_is_queued(engine):
    async def main():
        with pytest.raises(ValueError, match="token id"):
            await collect(engine, [10**9], SamplingParams(max_tokens=4), "bad-ids")
        with pytest.raises(ValueError, match="temperature"):
            await collect(engine, "x", SamplingParams(temperature=float("nan")), "bad-t")

    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    asyncio.run(main())
    assert engine.call(lambda e: (len(e.groups), e.has_unfinished_requests())) == (0, False)


def test_a_duplicate_request_id_is_refused(engine):
    async def main():
        first = engine.generate(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="dup"):
            await collect(engine, PROMPTS[1], SamplingParams(max_tokens=4), "dup")
        await first.aclose()

    asyncio.run(main())


def test_after_shutdown_generate_raises():
    eng = AsyncLLM(max_model_len=128, max_num_seqs=2)
    eng.shutdown()
    eng.shutdown()  # idempotent

    async def main():
        await collect(eng, "x", SamplingParams(max_tokens=2), "late")

    with pytest.raises(EngineDeadError):
        asyncio.run(main())


def test_health_reports_a_stalled_engine_loop(engine):
    """A loop that makes no progress (here: a call that blocks the engine thread until released) turns
    /health to 503, and back to 200 once it moves again. The block lasts until the test has seen the 503,
    so how busy the machine is decides nothing."""
    import threading
    import time

    from fastapi.testclient import TestClient

    from workbench.server.api_server import build_app

    app = build_app(engine, "m", health_stall_s=1.0)
    client = TestClient(app)  # (not entered: the lifespan would shut the shared engine down)
    release = threading.Event()
    blocker = threading.Thread(target=engine.call, args=(lambda e: release.wait(120),), kwargs={"timeout": 180})

    def wait_for(status: int) -> None:
        deadline = time.monotonic() + 120
        while client.get("/health").status_code != status:
            assert time.monotonic() < deadline, f"/health never answered {status}"
            time.sleep(0.1)

    wait_for(200)
    blocker.start()
    try:
        wait_for(503)
    finally:
        release.set()
        blocker.join()
    wait_for(200)


def test_the_engine_is_built_on_the_thread_that_steps_it(monkeypatch):
    """The model loads on the engine thread, not the caller's: a caller that never ran torch starts no
    OpenMP team of its own, so the engine thread's team is the only one and its workers keep their spin
    (with two teams on two cores GNU OpenMP throttles it, and every small op waits for a wake-up)."""
    import threading

    from workbench.entrypoints import async_llm

    built_on: list[str] = []

    class Recording(async_llm.LLMEngine):
        def __init__(self, *a, **k):
            built_on.append(threading.current_thread().name)
            super().__init__(*a, **k)

    monkeypatch.setattr(async_llm, "LLMEngine", Recording)
    eng = AsyncLLM(max_model_len=128, max_num_seqs=2)
    try:
        stepped_on = eng.call(lambda e: threading.current_thread().name)
    finally:
        eng.shutdown()
    assert built_on == [stepped_on] == ["workbench-engine"]


def test_an_engine_that_fails_to_build_raises_in_the_caller_and_leaves_no_thread():
    import threading

    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="fewer than max_model_len=256"):
        AsyncLLM(max_model_len=256, num_gpu_blocks_override=1)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
