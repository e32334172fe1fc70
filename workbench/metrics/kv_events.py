"""Publishing KV-cache events over ZeroMQ as vLLM does (``--kv-events-config``): a PUB socket sends each
step's batch as three frames ``[topic, sequence number (8 bytes, big-endian), msgpack payload]``
(:func:`workbench.kv.events.encode_batch`), and an optional ROUTER socket replays the batches kept in memory
from a sequence number a subscriber asks for, ending with sequence ``-1`` and an empty payload.

A thread owns both sockets (ZMQ sockets are not thread-safe) and sends what the engine queues, so a slow
subscriber never holds up a step: ZMQ drops batches for a subscriber past the high-water mark, as vLLM's does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from workbench.kv.events import KVCacheEvent, KVEventsConfig, encode_batch

log = logging.getLogger(__name__)

#: the replay's end marker: sequence number -1 (8 bytes, big-endian, signed)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class NullEventPublisher:
    """Takes the events and drops them (vLLM's ``"null"`` publisher)."""

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> None:
        return None

    def shutdown(self) -> None:
        return None


def start_kv_events(config) -> ZmqEventPublisher | NullEventPublisher | None:
    """The publisher ``config.kv_events_config`` (an :class:`~workbench.config.EngineConfig`) asks for: ``None``
    when events are off; else the engine hands it what the KV manager recorded
    (:class:`~workbench.kv.events.EventedKVCacheManager`) every step, and it sends them (``"zmq"``) or drops them
    (``"null"``)."""
    events = KVEventsConfig.parse(config.kv_events_config)
    if not (events and events.enable_kv_cache_events):
        return None
    if not events.publishes:
        return NullEventPublisher()
    pub = ZmqEventPublisher(events)
    how = "bound" if binds(events.endpoint) else "connected to"
    log.info("KV-cache events: publishing on %s (%s; replay: %s)", pub.address, how, events.replay_endpoint)
    return pub


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (else it connects to it). vLLM binds ``*``, ``::``, ``ipc://``
    and ``inproc://`` addresses and connects to the rest; workbench also binds a loopback address
    (``127.x.x.x``, ``localhost``, ``[::1]``), so that replicas on one machine publish on loopback only and
    a router's subscriber connects to each (``tcp://*`` would listen on every interface)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


class ZmqEventPublisher:
    """Sends event batches on ``config.endpoint`` (bound or connected to: :func:`binds`) and answers replay
    requests on ``config.replay_endpoint`` (bound).

    Raises:
        ValueError: an endpoint ZMQ cannot bind or connect (the message names it).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        opening = "endpoint"
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                opening = "replay_endpoint"
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(
                f"kv_events_config: cannot open {opening}={getattr(config, opening)!r}: {e}; give another address, "
                "e.g. another free port on tcp://127.0.0.1"
            ) from None
        #: the address the PUB socket is bound or connected to (a wildcard port resolved)
        self.address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        #: batches queued by :meth:`publish` and sent on the PUB socket so far
        self.num_queued = self.num_published = 0
        self._thread = threading.Thread(target=self._run, name="workbench-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> None:
        """Queue one batch (nothing when ``events`` is empty; encoded on the publisher's thread, off the step);
        ``ts``: seconds since the epoch (now)."""
        if events:
            self.num_queued += 1
            self._queue.put((time.time() if ts is None else ts, events))

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then close the sockets. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._close_sockets()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a malformed request must not stop publishing
                    log.exception("KV-event replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            payload = encode_batch(*item, self.data_parallel_rank)
            seq = self._seq
            self._seq += 1
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.num_published += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignored a KV-event replay request of %d frames (want: identity, empty, sequence)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None and not s.closed:
                s.close(linger=0)
