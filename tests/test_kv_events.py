"""KV-cache events in vLLM's format (``--kv-events-config``): the manager announces every block it caches and
every block it evicts, and nothing else; the engine publishes them over ZeroMQ as vLLM does, and a reader
built from vLLM's own struct declarations (msgspec: the batch ``array_like``, the events tagged structs; an
implementation independent of the msgpack package that encodes ours) decodes them.

Loopback only: the publisher binds an ``ipc://`` socket in the test's temporary folder.
"""

from __future__ import annotations

import random
import time

import msgpack
import msgspec
import pytest
import zmq

from workbench.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventedKVCacheManager,
    KVEventsConfig,
    external_block_hash,
)
from workbench.kv.manager import KVCacheManager


# ----------------------------------------------------------------------------- vLLM's declarations, as facts of the format
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)


def replay(events, state: set[int] | None = None) -> set[int]:
    """The cached block hashes a subscriber believes in after ``events`` (either form)."""
    state = set() if state is None else state
    for e in events:
        if isinstance(e, BlockStored | VBlockStored):
            assert not state & set(e.block_hashes), "a block announced stored twice"
            state |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved | VBlockRemoved):
            assert set(e.block_hashes) <= state, "a block announced removed that was never stored"
            state -= set(e.block_hashes)
        else:
            state.clear()
    return state


def cached(kv: KVCacheManager) -> set[int]:
    return {external_block_hash(h) for h in kv.pool.cached}


# ----------------------------------------------------------------------------- the manager's events
def test_random_schedules_announce_exactly_the_cached_blocks():
    """Requests with shared prefixes come and go on a small pool (evictions happen): after every operation,
    the events so far describe exactly the blocks in the prefix cache, removals match the evictions, and
    every stored event's tokens are its blocks' tokens, block_size per block, chained to the parent."""
    rng = random.Random(0)
    bs = 4
    kv = EventedKVCacheManager(24, bs, enable_prefix_caching=True)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    believed: set[int] = set()
    removed = 0
    live: dict[str, list[int]] = {}
    for step in range(300):
        if live and (rng.random() < 0.45 or len(live) > 3):
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        else:
            rid = f"r{step}"
            ids = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
            hit = kv.find_cached_prefix(ids)
            if not kv.allocate_slots(rid, len(ids), hit):
                continue
            kv.cache_full_blocks(rid, ids, len(ids))
            live[rid] = ids
        events = kv.take_events()
        for e in events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * bs and e.block_size == bs
            if isinstance(e, BlockRemoved):
                removed += len(e.block_hashes)
        believed = replay(events, believed)
        assert believed == cached(kv), f"step {step}"
        kv.check_invariants()
    assert removed == kv.pool.num_evictions > 0
    assert kv.take_events() == []


def test_a_stored_event_names_its_parent_and_tokens():
    kv = EventedKVCacheManager(8, 4, enable_prefix_caching=True)
    ids = list(range(10, 22))  # three full blocks
    assert kv.allocate_slots("a", len(ids))
    kv.cache_full_blocks("a", ids, 8)  # two blocks computed
    kv.cache_full_blocks("a", ids, 12)  # the third
    first, second = kv.take_events()
    hashes = [external_block_hash(h) for h in kv._hashes["a"]]
    assert first == BlockStored(hashes[:2], None, ids[:8], 4)
    assert second == BlockStored(hashes[2:], hashes[1], ids[8:12], 4)


def test_no_events_without_prefix_caching_and_none_recorded_by_the_plain_manager():
    kv = EventedKVCacheManager(8, 4)
    assert kv.allocate_slots("a", 8)
    kv.cache_full_blocks("a", list(range(8)), 8)
    assert kv.take_events() == []
    plain = KVCacheManager(8, 4, enable_prefix_caching=True)
    assert plain.pool.events is None  # the engine builds the evented manager only with kv_events_config


def test_the_engine_builds_the_evented_manager_only_when_events_are_on(tiny_model):
    from workbench.config import EngineConfig
    from workbench.kv import make_kv_manager

    on = EngineConfig(
        model=str(tiny_model), enable_prefix_caching=True, kv_events_config={"enable_kv_cache_events": True}
    )
    off = EngineConfig(model=str(tiny_model), enable_prefix_caching=True, kv_events_config="{}")
    assert type(make_kv_manager(on, 8)) is EventedKVCacheManager
    assert type(make_kv_manager(off, 8)) is KVCacheManager


def test_the_wire_layout_is_vllms():
    from workbench.kv.events import encode_batch

    events = [BlockStored([1, 2], None, list(range(8)), 4), BlockRemoved([1]), AllBlocksCleared()]
    batch = DECODER.decode(encode_batch(12.5, events, 0))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    assert batch.events == [
        VBlockStored([1, 2], None, list(range(8)), 4, None, "GPU", None),
        VBlockRemoved([1], "GPU"),
        VAllBlocksCleared(),
    ]
    raw = msgpack.unpackb(encode_batch(12.5, events[1:], 0))
    assert raw == [
        12.5,
        [{"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}, {"type": "AllBlocksCleared"}],
        0,
    ]
    assert list(msgpack.unpackb(encode_batch(0, events[:1]))[1][0]) == [  # the tag first, then vLLM's field order
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert external_block_hash(b"\xff" * 32) == 2**64 - 1  # the low 64 bits, unsigned


@pytest.mark.parametrize(
    "value, match",
    [
        ("{not json", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable": true}', r"unknown field\(s\) \['enable'\]"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events='yes' must be true or false"),
        ('{"publisher": "kafka"}', "publisher='kafka'"),
        ('{"endpoint": "localhost:5557"}', "endpoint='localhost:5557' must be a ZMQ address"),
        ('{"hwm": 0}', "hwm=0 must be a whole number"),
        ('{"endpoint": "tcp://127.0.0.1:99999"}', "port 1-65535"),  # ZMQ would wrap it to another port
        ('{"endpoint": "tcp://127.0.0.1:abc"}', "endpoint='tcp://127.0.0.1:abc'"),
        ('{"replay_endpoint": "127.0.0.1:5558"}', "replay_endpoint='127.0.0.1:5558'"),
    ],
)
def test_a_bad_config_names_the_field(value, match):
    with pytest.raises(ValueError, match=match):
        KVEventsConfig.parse(value)


def test_an_address_in_use_is_named_and_a_wildcard_port_resolved():
    from workbench.metrics.kv_events import ZmqEventPublisher, binds

    assert binds("tcp://127.0.0.1:5557") and binds("tcp://localhost:5557") and binds("tcp://*:5557")
    assert not binds("tcp://192.0.2.2:5557")  # another host: connected to, as vLLM does
    first = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*"))
    try:
        port = int(first.address.rsplit(":", 1)[1])
        assert first.address.startswith("tcp://127.0.0.1:") and port > 0
        with pytest.raises(ValueError, match=f"cannot open endpoint='tcp://127.0.0.1:{port}'"):
            ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}"))
        free = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", replay_endpoint=f"tcp://127.0.0.1:{port}")
        with pytest.raises(ValueError, match=f"cannot open replay_endpoint='tcp://127.0.0.1:{port}'"):
            ZmqEventPublisher(free)
    finally:
        first.shutdown()


def test_config_defaults_follow_vllm():
    assert KVEventsConfig.parse(None) is None
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (on.publisher, on.endpoint, on.buffer_steps, on.hwm, on.topic) == (
        "zmq",
        "tcp://*:5557",
        10_000,
        100_000,
        "",
    )
    assert KVEventsConfig.parse("{}").publisher == "null"


def test_the_engine_refuses_events_without_prefix_caching(tiny_model):
    from workbench.config import EngineConfig

    cfg = EngineConfig(model=str(tiny_model), kv_events_config={"enable_kv_cache_events": True})
    with pytest.raises(ValueError, match="--enable-prefix-caching"):
        cfg.validate()


# ----------------------------------------------------------------------------- published by a running engine
def test_an_engine_publishes_what_its_cache_did_and_replays_it(tiny_model, tmp_path):
    """A real engine (tiny model, a pool small enough to evict) runs shared-prefix prompts with events on.
    The replay socket sends every batch from sequence 0, in order, then the end marker; decoded by vLLM's
    declarations, the blocks they describe are the engine's prefix cache at the end and the removals its
    evictions. A SUB socket receives the same frames live (from whenever its subscription reached the
    publisher: ZMQ's PUB drops what it sends before then, so the live frames are a suffix)."""
    from workbench.entrypoints.llm import LLM
    from workbench.sampling import SamplingParams

    endpoint, replay_ep = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    cfg = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_ep, "topic": "kv"}
    llm = LLM(
        model=str(tiny_model),
        max_model_len=128,
        block_size=4,
        num_gpu_blocks_override=40,
        enable_prefix_caching=True,
        kv_events_config=cfg,
    )
    try:
        sub.connect(endpoint)
        prefix = list(range(3, 23))
        prompts = [{"prompt_token_ids": prefix + [30 + i] * (3 + i)} for i in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        kv = llm.llm_engine.kv
        pub = llm.llm_engine.kv_event_publisher
        deadline = time.monotonic() + 60
        while pub.num_published < pub.num_queued:
            assert time.monotonic() < deadline, "the publisher did not send its queue"
            time.sleep(0.05)
        total = pub.num_published

        req = ctx.socket(zmq.DEALER)
        req.connect(replay_ep)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        frames = []
        while True:
            assert req.poll(60_000), "the replay socket did not answer"
            _, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            frames.append((int.from_bytes(seq, "big"), payload))
        req.close(linger=0)
        assert [s for s, _ in frames] == list(range(total)) and total > 0

        batches = [DECODER.decode(p) for _, p in frames]
        events = [e for b in batches for e in b.events]
        assert any(isinstance(e, VBlockRemoved) for e in events), "the pool was meant to evict"
        assert replay(events) == cached(kv)
        assert sum(len(e.block_hashes) for e in events if isinstance(e, VBlockRemoved)) == kv.pool.num_evictions
        assert all(b.data_parallel_rank == 0 and b.ts > 1e9 for b in batches)

        live = []
        while not live or live[-1][0] < total - 1:  # every frame sent reaches a joined subscriber, in order
            assert sub.poll(60_000), f"the SUB socket received {len(live)} frames, not the last"
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            live.append((int.from_bytes(seq, "big"), payload))
        assert live == frames[len(frames) - len(live) :], "the live stream differs from the replay"
    finally:
        sub.close(linger=0)
        llm.shutdown()
