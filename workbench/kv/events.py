"""KV-cache events in vLLM's format: what a prefix-caching KV manager stored and removed, for a router
(vLLM's ``kv_aware`` policy) or any subscriber written for vLLM.

The events and their wire layout follow vLLM (``vllm/distributed/kv_events.py``, ``--kv-events-config``):

- :class:`BlockStored` — full blocks entered the prefix cache: their hashes, the hash of the block before
  the first (``None`` at the start of a prompt), their token ids (``block_size`` per block), the block size,
  ``lora_id``, ``medium`` (``"GPU"``: the device pool) and ``lora_name``;
- :class:`BlockRemoved` — cached blocks were evicted (handed out for new content);
- :class:`AllBlocksCleared` — the whole prefix cache was dropped.

On the wire (msgpack, as vLLM's ``msgspec`` structs encode them: the batch ``array_like``, the events
tagged maps, fields with their default left out) a batch is ``[ts, [event, ...], data_parallel_rank]`` and an
event is a map whose ``"type"`` is its class name: ``{"type": "BlockStored", "block_hashes", "parent_block_hash",
"token_ids", "block_size", "lora_id", "medium", "lora_name"}``, ``{"type": "BlockRemoved", "block_hashes",
"medium"}``, ``{"type": "AllBlocksCleared"}``. A block hash is vLLM's external form: the
content hash (SHA-256 here, :func:`workbench.kv.manager.block_hash`) as an unsigned 64-bit integer
(:func:`external_block_hash`). Hashes are equal for equal prefixes within one engine; like vLLM's (whose
seed is random unless ``PYTHONHASHSEED`` is set) they are not meant to match another engine's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from workbench.kv.manager import KVCacheManager, block_hash

#: where the blocks live: the device pool (vLLM's ``MEDIUM_GPU``, the name it uses for any device)
MEDIUM_GPU = "GPU"


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None

    def to_wire(self) -> dict:
        return {"type": "BlockStored", **asdict(self)}


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM_GPU

    def to_wire(self) -> dict:
        return {"type": "BlockRemoved", **asdict(self)}


@dataclass
class AllBlocksCleared:
    def to_wire(self) -> dict:
        return {"type": "AllBlocksCleared"}


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def external_block_hash(h: bytes) -> int:
    """A block's content hash as vLLM publishes it: the bytes as a big-endian integer, its low 64 bits."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1)


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    """One batch as vLLM's publisher sends it (msgpack ``[ts, events, data_parallel_rank]``)."""
    import msgpack

    return msgpack.packb([float(ts), [e.to_wire() for e in events], data_parallel_rank], use_bin_type=True)


@dataclass
class KVEventsConfig:
    """``--kv-events-config``: vLLM's fields and defaults (``vllm/config/kv_events.py``).

    Attributes:
        enable_kv_cache_events: record the prefix cache's stored and removed blocks.
        publisher: ``"zmq"`` or ``"null"``; ``None`` means ``"zmq"`` when events are enabled, else ``"null"``.
        endpoint: the ZMQ PUB address; ``tcp://*:5557`` binds every interface, ``tcp://127.0.0.1:5557``
            loopback only (vLLM would connect to it instead: see
            :func:`workbench.metrics.kv_events.binds`), another host is connected to.
        replay_endpoint: a ZMQ ROUTER address where a subscriber asks for the batches from a sequence number on.
        buffer_steps: batches kept for replay.
        hwm: ZMQ's high-water mark of the PUB socket (batches queued per slow subscriber before dropping).
        max_queue_size: batches waiting for the publisher thread before the engine blocks.
        topic: the first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    @classmethod
    def parse(cls, value: Any) -> KVEventsConfig | None:
        """``value`` (a JSON object, as text or a dict; ``None``: no events) as a config.

        Raises:
            ValueError: not a JSON object, an unknown field, or a field of the wrong type or range
                (the message names the field and the fix).
        """
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"kv_events_config is not JSON ({e.msg} at character {e.pos}); give an object such as "
                    '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557"}\''
                ) from None
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config has unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**value)
        cfg._check()
        return cfg

    def _check(self) -> None:
        def bad(name: str, want: str):
            return ValueError(f"kv_events_config.{name}={getattr(self, name)!r} must be {want}")

        if not isinstance(self.enable_kv_cache_events, bool):
            raise bad("enable_kv_cache_events", "true or false")
        if self.publisher not in ("zmq", "null"):
            raise bad("publisher", '"zmq" or "null"')
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise bad(name, "a string")
        if not _zmq_address(self.endpoint):
            raise bad("endpoint", "a ZMQ address: tcp://host:port (port 1-65535), ipc://path or inproc://name")
        if self.replay_endpoint is not None and not _zmq_address(self.replay_endpoint):
            raise bad("replay_endpoint", "null or a ZMQ address: tcp://host:port (port 1-65535), ipc://path, inproc://name")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "a whole number >= 1")

    @property
    def publishes(self) -> bool:
        """Events are recorded and sent over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def _zmq_address(value) -> bool:
    """``tcp://host:port`` with a port in 1-65535 (ZMQ would wrap a larger one silently) or ``*``, ``ipc://`` or
    ``inproc://`` with a name."""
    if not isinstance(value, str):
        return False
    if value.startswith(("ipc://", "inproc://")):
        return len(value.split("://", 1)[1]) > 0
    host, _, port = value.removeprefix("tcp://").rpartition(":")
    ok_port = port == "*" or (port.isdigit() and 1 <= int(port) <= 65535)  # "*": a free port, when bound
    return value.startswith("tcp://") and bool(host) and ok_port


def kv_events_enabled(config) -> bool:
    """Whether ``config.kv_events_config`` (an :class:`~workbench.config.EngineConfig`) turns events on."""
    events = KVEventsConfig.parse(config.kv_events_config)
    return bool(events and events.enable_kv_cache_events)


def check_kv_events(config) -> None:
    """Check ``config.kv_events_config`` (an :class:`~workbench.config.EngineConfig`): it parses, and events
    come with ``enable_prefix_caching`` (they report what the prefix cache stores and evicts).

    Raises:
        ValueError: naming the field and the fix.
    """
    events = KVEventsConfig.parse(config.kv_events_config)
    if events is not None and events.enable_kv_cache_events and not config.enable_prefix_caching:
        raise ValueError(
            "kv_events_config enables KV-cache events, which report the blocks the prefix cache stores and "
            "evicts, but prefix caching is off; pass --enable-prefix-caching (enable_prefix_caching=True)"
        )


class EventedKVCacheManager(KVCacheManager):
    """The paged manager that records its KV-cache events (what ``kv_events_config`` turns on): a
    :class:`BlockStored` for each run of a request's full blocks that enters the prefix cache, and (its pool)
    a :class:`BlockRemoved` for each allocation's evictions, in the order they happen."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pool.events = []

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes.setdefault(request_id, [])
        table = self.block_tables[request_id]
        run: list[int] = []  # consecutive blocks that entered the cache: one event
        for i in range(len(hashes), num_computed // bs):
            hashes.append(block_hash(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs]))
            if self.pool.cache_block(table[i], hashes[-1]):
                run.append(i)
            elif run:
                self.pool.events.append(self._stored(hashes, token_ids, run))
                run = []
        if run:
            self.pool.events.append(self._stored(hashes, token_ids, run))

    def _stored(self, hashes: list[bytes], token_ids: list[int], blocks: list[int]) -> BlockStored:
        first, last, bs = blocks[0], blocks[-1], self.block_size
        return BlockStored(
            [external_block_hash(hashes[i]) for i in blocks],
            external_block_hash(hashes[first - 1]) if first else None,
            list(token_ids[first * bs : (last + 1) * bs]),
            bs,
        )

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first; the pool's consecutive evictions (hashes)
        become one ``BlockRemoved``."""
        out: list[KVCacheEvent] = []
        for e in self.pool.events:
            if not isinstance(e, bytes):
                out.append(e)
            elif out and isinstance(out[-1], BlockRemoved):
                out[-1].block_hashes.append(external_block_hash(e))
            else:
                out.append(BlockRemoved([external_block_hash(e)]))
        self.pool.events = []
        return out
