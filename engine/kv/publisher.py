"""KV events on the wire, in the current vLLM release's format (vLLM 0.33.0): what routers built
for vLLM read (Note [KV events] in engine/kv/events.py says what is announced and who records it).

The config is vLLM's `KVEventsConfig` (`--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint":
"tcp://127.0.0.1:5558", "topic": "kv"}'`, or `LLM(kv_events_config={...})`), with four fields of
vkv's (engine/config.py). The wire is vLLM 0.33.0's (vllm/distributed/kv_events.py):
  PUB     each batch as a ZMQ multipart message (topic, sequence number as 8 bytes big-endian,
          payload), the payload a msgpack `KVEventBatch` [ts, events, data_parallel_rank]
          whose events are maps tagged by "type": {"type": "BlockStored", "block_hashes",
          "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
          "group_idx"}, {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"},
          {"type": "AllBlocksCleared"} (fields left at their defaults are left out, as vLLM's)
  replay  a ROUTER socket: a client (REQ or DEALER) sends a starting sequence number (8 bytes
          big-endian); it gets every kept batch from there as (topic, sequence, payload), then
          ("", -1, "") to say it is up to date
tests/kv/vllm_kv_events.py holds that release's schema verbatim, and the suite decodes with it;
benchmarks/check_kv_events_vllm.py decodes with the installed vLLM package itself.

Tenants. A stored page's tokens are its prompt's text to anyone who reads them, and llm-d and
Dynamo both hash token_ids (they need them to match prompts to pages). With `token_ids` false,
as `vkv serve --isolate-clients` makes it unless subscribers authenticate, pages are announced
by name, parent and size only (vkv's own routers match on names); with `curve_secret_key` and
`curve_client_keys` the sockets are CURVE servers that admit only the listed public keys. An
endpoint off this machine needs `allow_remote` (engine/config.py checks each at start).

An endpoint is bound when it names every interface (`*`), a loopback address, `ipc://` or
`inproc://`, and connected to otherwise (vLLM binds only the first and the last two: here a
loopback address binds, so the default stays on this machine). With data parallelism, rank R's
TCP ports are the configured ones plus R, as vLLM's.

A thread of its own encodes and sends, so the engine's step only hands over a list; a full
queue drops the batch and counts it (`dropped`) rather than stall a step.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from urllib.parse import urlsplit

import msgspec
import zmq

from engine.config import KVEventsConfig
from engine.kv.events import Cleared, Removed, Stored

log = logging.getLogger("vkv.kv_events")
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event's tag is its class name, under the key "type", as vLLM 0.33's."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None  # (vLLM's KV cache group: vkv has one, 0)


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hash(name: bytes) -> int:
    """A page's name (SHA-256 chain hash) as vLLM's integer block hash: its first 8 bytes."""
    return int.from_bytes(name[:8], "big")


def to_wire(event, token_ids: bool = True) -> KVCacheEvent:
    """An event as vLLM's; token_ids False: a stored page without its tokens (tenants)."""
    if isinstance(event, Stored):
        return BlockStored([block_hash(n) for n in event.names],
                           block_hash(event.parent) if event.parent is not None else None,
                           event.token_ids if token_ids else [], event.block_size, None, event.medium,
                           event.lora_name, 0)
    if isinstance(event, Removed):
        return BlockRemoved([block_hash(n) for n in event.names], event.medium, 0)
    assert isinstance(event, Cleared)
    return AllBlocksCleared()


def rank_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Rank R's endpoint: TCP port + R, or `inproc://name_dpR` (vLLM's rule)."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return endpoint  # ipc://: one path each is the user's to give


def binds(endpoint: str) -> bool:  # (which endpoints may stay: engine/config.py endpoint_is_local)
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint).hostname or ""
    return "*" in endpoint or host in LOOPBACK or host == "::" or host == "0.0.0.0"


class ZmqEventPublisher:
    """Batches of events out on a PUB socket, the last `buffer_steps` kept for replay."""
    END = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.config, self.rank = config, data_parallel_rank
        self.endpoint = rank_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = rank_endpoint(config.replay_endpoint, data_parallel_rank)
        self.topic = config.topic.encode()
        self.token_ids = config.token_ids is not False  # (None: yes; a server isolating clients said no)
        self.queue: queue.Queue = queue.Queue(config.max_queue_size)
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.sent = self.dropped = self.next_seq = 0
        ctx = zmq.Context.instance()
        self.auth = None
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(config.hwm)
        self.replay = None
        try:
            if config.curve_secret_key:
                self.auth = self._curve(ctx, self.pub)
            (self.pub.bind if binds(self.endpoint) else self.pub.connect)(self.endpoint)
            if self.replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.set_hwm(2 * (config.buffer_steps + 1))
                if config.curve_secret_key:
                    self._curve(ctx, self.replay)
                self.replay.bind(self.replay_endpoint)
        except (zmq.ZMQError, OSError, ValueError) as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {self.endpoint}"
                             f"{' / ' + self.replay_endpoint if self.replay_endpoint else ''}: {exc}") from exc
        self.thread = threading.Thread(target=self._run, name="vkv-kv-events", daemon=True)
        self.thread.start()
        log.info("vkv: KV events on %s%s (topic %r)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "", config.topic)

    def _curve(self, ctx, sock):
        """sock as a CURVE server with this config's key pair; an authenticator (one a
        publisher) admits only the public keys in curve_client_keys."""
        import zmq.auth
        from zmq.auth.thread import ThreadAuthenticator
        public, secret = zmq.auth.load_certificate(self.config.curve_secret_key)
        if secret is None:
            raise ValueError(f"{self.config.curve_secret_key} holds no secret key")
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        if self.auth is None:
            self.auth = ThreadAuthenticator(ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=self.config.curve_client_keys)
        return self.auth

    def publish(self, events: list) -> None:
        """Queue one batch (the engine's events since the last); never blocks. Its sequence number
        is taken here, so a batch dropped for a full queue (the sending thread stalled) leaves a
        gap that subscribers see, as vLLM's do, instead of a silent hole."""
        if not events:
            return
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self.queue.put_nowait((seq, KVEventBatch(time.time(), [to_wire(e, self.token_ids) for e in events],
                                                     self.rank)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("vkv: KV event batches dropped, the sending thread behind: %d so far (sequence gaps)",
                            self.dropped)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            try:
                if self.replay is not None and self.replay.poll(0):
                    if not self._send_queued(encoder):
                        return
                    self._answer_replay()
                try:
                    item = self.queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if not self._send(encoder, item):
                    return
            except Exception:  # (a closed context at exit, a bug): said, and the thread goes on
                if self.pub.closed:
                    return
                log.exception("vkv: sending a KV event batch failed")

    def _send_queued(self, encoder) -> bool:
        """Every batch queued now, sent and kept (before a replay is answered: a client that asks
        right after a publish() returned finds that batch; under load this thread could see the
        request before it had taken the batch). False if close's None came among them."""
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return True
            if not self._send(encoder, item):
                return False

    def _send(self, encoder, item) -> bool:
        """A queued batch out on the PUB socket and into the replay buffer; False for close's None."""
        if item is None:
            return False
        seq, batch = item
        payload = encoder.encode(batch)
        self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.kept.append((seq, payload))
        self.sent += 1
        return True

    def _answer_replay(self) -> None:
        frames = self.replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("vkv: a KV event replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self.kept):
            if seq >= first:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", self.END, b""))

    def close(self) -> None:
        """Send what is queued (up to a second), then close the sockets."""
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(timeout=1.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=200)  # ms for the last batches to leave
        if self.auth is not None:
            self.auth.stop()


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    return ZmqEventPublisher(config, data_parallel_rank) if config and config.publishes else None
