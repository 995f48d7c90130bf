"""KV events in vLLM's format (engine/kv/events.py, engine/kv/publisher.py): decoded here with
the current vLLM release's own schema (tests/kv/vllm_kv_events.py, verbatim), they account for every page the pool's prefix cache and the tiers take in
and let go, once each, in order; the replay socket serves what a subscriber missed."""
import json
import os
import time

import msgspec
import pytest
import zmq
from helpers import NARROW

from engine import LLM, SamplingParams
from engine.kv.events import CPU, GPU, STORAGE, AnnouncedEntries, KVEventLog
from engine.config import KVEventsConfig
from engine.kv.publisher import block_hash, rank_endpoint
from vllm_kv_events import BlockRemoved, BlockStored, KVEventBatch  # vLLM 0.33.0's own schema, verbatim


DECODE = msgspec.msgpack.Decoder(KVEventBatch)
PROMPTS = [f"Story {i}: " + " ".join(f"word{i}x{j}" for j in range(52)) for i in range(3)]  # test_kv_tiers'
POOL = 20 << 20  # holds about one prompt: the others are evicted to the tiers
GREEDY = SamplingParams(temperature=0, max_tokens=4)


class Holdings:
    """What a router learns from the stream: the set of block hashes in each medium."""

    def __init__(self):
        self.media = {GPU: set(), CPU: set(), STORAGE: set()}
        self.chains: dict[int, list[int]] = {}  # GPU block hash -> the tokens from the sequence's start

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held = self.media[ev.medium]
                for h in ev.block_hashes:
                    assert h not in held, f"{ev.medium} block {h:x} announced stored twice"
                    held.add(h)
                if ev.medium == GPU and ev.token_ids:
                    assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                    tokens = self.chains[ev.parent_block_hash][:] if ev.parent_block_hash is not None else []
                    for i, h in enumerate(ev.block_hashes):
                        tokens += ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
                        self.chains[h] = tokens[:]
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in self.media[ev.medium], f"{ev.medium} block {h:x} removed but never stored"
                    self.media[ev.medium].discard(h)
            else:
                self.media[GPU].clear()


def replay(endpoint: str, start: int = 0) -> list[tuple[int, KVEventBatch]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)  # (a REQ socket takes one reply; replay sends many)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert sock.poll(5000), "no answer from the replay socket"
        _, topic, seq, payload = sock.recv_multipart()  # (vLLM 0.33's replay frames: topic, sequence, payload)
        seq = int.from_bytes(seq, "big", signed=True)
        if seq < 0:
            break
        out.append((seq, DECODE.decode(payload)))
    sock.close(linger=0)
    return out


def drain(sub) -> list[tuple[int, KVEventBatch]]:
    out = []
    while sub.poll(1000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        out.append((int.from_bytes(seq, "big"), DECODE.decode(payload)))
    return out


@pytest.mark.parametrize("layout", ["per_layer", "paged"])
def test_every_page_stored_evicted_tiered_and_let_go_is_announced_once_in_order(tmp_path, layout):
    pub, rep = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(pub)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": rep,
              "topic": "kv"}
    llm = LLM(model=NARROW, kv_layout=layout, kv_cache_memory=POOL, max_num_seqs=1, kv_offloading_size=0.01,
              kv_offloading_path=str(tmp_path / "disk"), kv_events_config=config, data_parallel_rank=0)
    time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
    try:
        sequences = []  # each request's prompt and output tokens
        for _ in range(2):
            for p in PROMPTS:
                (out,) = llm.generate([p], GREEDY, use_tqdm=False)
                sequences.append(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
        batches = replay(rep)
        assert [seq for seq, _ in batches] == list(range(len(batches))) and batches
        seen = Holdings()
        for _, batch in batches:
            assert batch.data_parallel_rank == 0
            seen.apply(batch)
        kv = llm.engine.kv
        tiers = kv.tiers
        # the stream says exactly what each medium holds now
        assert seen.media[GPU] == {block_hash(n) for n in kv.prefix_cache.entries}
        assert seen.media[CPU] == {block_hash(n) for n in tiers.host.entries} and seen.media[CPU]
        assert seen.media[STORAGE] == {block_hash(n) for n in tiers.disk.index} and seen.media[STORAGE]
        assert kv.prefix_cache.evictions > 0 and tiers.host.dropped > 0  # evictions and tier drops both seen
        # each sequence's announced tokens are its prompt's tokens, page after page
        for tokens in seen.chains.values():
            assert any(ids[:len(tokens)] == tokens for ids in sequences)
        assert max(len(t) for t in seen.chains.values()) >= 170
    finally:
        llm.close()
    live = drain(sub)  # the live stream, through close (the cache let go to the tiers)
    sub.close(linger=0)
    assert [seq for seq, _ in live] == list(range(len(live))), "the subscriber missed or reordered batches"
    assert [b for _, b in live[:len(batches)]] == [b for _, b in batches]
    after = Holdings()
    for _, batch in live:
        after.apply(batch)
    assert not after.media[GPU], "the pool's pages were let go at close without being announced"
    assert not after.media[CPU] and not after.media[STORAGE], "the tiers went with the engine unannounced"

    # a restarted engine announces the disk tier's files before any request
    files = {block_hash(bytes.fromhex(f.stem)) for f in (tmp_path / "disk").glob("*/*.kv")}
    with LLM(model=NARROW, kv_layout=layout, kv_cache_memory=POOL, max_num_seqs=1,
             kv_offloading_path=str(tmp_path / "disk"), kv_events_config=config) as llm:
        llm.engine.publish_kv_events()
        found = Holdings()
        for _, batch in replay(rep):
            found.apply(batch)
        assert found.media[STORAGE] == files and files


def test_without_tiers_sleep_clears_all_and_ranks_offset_ports(tmp_path):
    rep = f"ipc://{tmp_path}/r"
    config = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/p", "replay_endpoint": rep}
    with LLM(model=NARROW, kv_cache_memory=POOL, kv_events_config=config, data_parallel_rank=3) as llm:
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        llm.sleep()
        batches = [b for _, b in replay(rep)]
    assert all(b.data_parallel_rank == 3 for b in batches)
    kinds = [type(e).__name__ for b in batches for e in b.events]
    assert kinds[0] == "BlockStored" and kinds[-1] == "AllBlocksCleared" and "BlockRemoved" not in kinds
    assert rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and rank_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_a_batch_dropped_for_a_full_queue_leaves_a_gap_subscribers_see(tmp_path):
    """Its sequence number is taken when it is published: a subscriber (and replay) sees the
    gap, as vLLM's do, instead of a stream that looks whole."""
    import queue

    from engine.kv.events import Removed
    from engine.kv.publisher import ZmqEventPublisher
    rep = f"ipc://{tmp_path}/r"
    pub = ZmqEventPublisher(KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/p",
                                               "replay_endpoint": rep}), 0)
    try:
        pub.publish([Removed([b"a" * 32], GPU)])
        def full(item):  # the sending thread behind: the queue full
            raise queue.Full

        pub.queue.put_nowait = full
        pub.publish([Removed([b"b" * 32], GPU)])  # dropped
        del pub.queue.put_nowait
        pub.publish([Removed([b"c" * 32], GPU)])
        time.sleep(0.3)
        assert pub.dropped == 1 and [seq for seq, _ in replay(rep)] == [0, 2]
    finally:
        pub.close()


def test_the_config_is_vllms_and_refuses_what_it_does_not_know():
    c = KVEventsConfig.of({"enable_kv_cache_events": True})
    assert c.publisher == "zmq" and c.endpoint.startswith("tcp://127.0.0.1")  # loopback by default
    assert KVEventsConfig.of({"enable_kv_cache_events": False}).publishes is False
    with pytest.raises(ValueError, match="unknown field.*'endpont'"):
        KVEventsConfig.of({"enable_kv_cache_events": True, "endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="unknown publisher 'kafka'"):
        KVEventsConfig.of({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="prefix caching"):
        LLM(model=NARROW, enable_prefix_caching=False, kv_events_config={"enable_kv_cache_events": True})


def test_a_tier_index_announces_every_way_an_entry_comes_and_goes():
    log = KVEventLog()
    log.start(16)
    index = AnnouncedEntries(log, CPU)
    index[b"a"] = 1
    index[b"a"] = 2  # already there: nothing new
    index[b"b"] = 3
    index[b"c"] = 4
    index.popitem(last=False)
    index.pop(b"missing", None)
    index.pop(b"b")
    index.clear()
    events = log.take()
    assert [(type(e).__name__, e.names) for e in events] == [
        ("Stored", [b"a", b"b", b"c"]), ("Removed", [b"a", b"b", b"c"])]
    assert events[0].block_size == 16 and log.take() == []


def test_metrics_routers_read_carry_vllms_names_and_meaning():
    import dataclasses
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from engine.serving.loop.metrics import Metrics
    with LLM(model=NARROW, kv_cache_memory=POOL) as llm:
        stats = llm.stats()
    busy = dataclasses.replace(stats, num_running=2, num_waiting=5, running_loras=("sql",), waiting_loras=("chat", "sql"),
                               max_loras=2, kv=dataclasses.replace(stats.kv, pages_in_use=stats.kv.pages_total // 4))
    pool = SimpleNamespace(pool=SimpleNamespace(num_pages=8, num_free=4))
    for labelled, snapshot in ((False, busy), (True, {"smol": busy})):
        metrics = Metrics(["smol"], pool) if labelled else Metrics()
        families = {f.name: f for f in text_string_to_metric_families(metrics.render(snapshot).decode())}
        value = lambda name: families[name].samples[0].value
        assert value("vllm:num_requests_running") == 2 and value("vllm:num_requests_waiting") == 5
        assert value("vllm:kv_cache_usage_perc") == pytest.approx(0.25, abs=1 / stats.kv.pages_total)
        (info,) = families["vllm:lora_requests_info"].samples
        assert info.labels["running_lora_adapters"] == "sql" and info.labels["waiting_lora_adapters"] == "chat,sql"
        assert info.labels["max_lora"] == "2" and info.value > 1.7e9
        assert ("model_name" in info.labels) == labelled


def test_a_shared_pool_is_announced_by_its_owner_once_for_every_process(tmp_path):
    """Over one pool several engines share (vmm/owner.py), the directory is the cache every
    process hits: its owner announces it (engine/kv/pool_events.py), the engines nothing of their
    own. Replayed, the stream holds exactly the directory's described entries, each page's tokens
    chained from the prompt's start; a page another engine maps is not announced again, a
    process letting go of its view removes nothing, eviction and the stop remove each once."""
    from engine.kv.pool_events import PoolEvents
    from vmm import HostBackend, PoolOwner

    rep = f"ipc://{tmp_path}/pool-replay"
    config = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/pool",
                                "replay_endpoint": rep})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(config.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    owner = PoolOwner(HostBackend(64 << 10), 600, str(tmp_path / "pool.sock"), announce=True).start()
    events = PoolEvents(owner, config, interval=0.05)
    time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
    engines = [LLM(model=NARROW, kv_pool=owner.path, kv_cache_memory=8 << 20, max_num_seqs=2, max_model_len=512)
               for _ in range(2)]
    try:
        sequences = []
        prompts = [PROMPTS[0], PROMPTS[0] + " and then more words", *PROMPTS[1:], PROMPTS[0]]
        for i, p in enumerate(prompts):  # alternate engines: each maps what the other computed
            (out,) = engines[i % 2].generate([p], GREEDY, use_tqdm=False)
            sequences.append(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))
        assert sum(e.stats().kv.prefix_cache_imported for e in engines) > 0  # pages crossed processes
        assert owner.stats()["evictions"] > 0  # the pool is small: the owner evicted for allocs
        events.flush()
        seen = Holdings()
        for _, batch in replay(rep):
            seen.apply(batch)
        with owner.lock:
            described = set(owner.announced)
        assert seen.media[GPU] == {block_hash(n) for n in described} and described
        for tokens in seen.chains.values():  # each announced page's tokens continue its prompt's
            assert any(ids[:len(tokens)] == tokens for ids in sequences)
    finally:
        for e in engines:
            e.close()
        owner.stop()
        events.close()
    live = drain(sub)
    sub.close(linger=0)
    assert [seq for seq, _ in live] == list(range(len(live))), "the subscriber missed or reordered batches"
    after = Holdings()
    for _, batch in live:
        after.apply(batch)
    assert not after.media[GPU], "the directory was let go at stop without being announced"


def test_pool_events_refuse_what_they_cannot_do_and_leave_nothing(tmp_path, monkeypatch):
    """An owner that does not announce is refused by name; a description too large for one owner
    message travels without its tokens (announced all the same); `-dp`'s replicas never get the
    events config (the front door announces); a publisher whose port is taken fails its start
    and the replicas' pool goes with it (no owner thread, no socket file)."""
    from engine.kv.pool_events import PoolEvents
    from engine.serving.dp.replicas import replica_argv
    from vmm import HostBackend, PoolOwner, wire
    from vmm.attach import _batches

    config = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/p"})
    owner = PoolOwner(HostBackend(64 << 10), 4, str(tmp_path / "quiet.sock"))
    with pytest.raises(ValueError, match="announce=True"):
        PoolEvents(owner, config)
    owner.stop()

    huge = [["ab" * 32, [0], {"parent": None, "tokens": list(range(100_000)), "size": 100_000, "lora": None}],
            ["cd" * 32, [1], {"parent": "ab" * 32, "tokens": [1, 2, 3], "size": 3, "lora": None}]]
    batches = list(_batches(huge))
    sent = [entry for batch in batches for entry in batch]
    assert sent[0][2] == {"parent": None, "tokens": [], "size": 100_000, "lora": None}
    assert sent[1][2]["tokens"] == [1, 2, 3]
    assert all(len(json.dumps({"op": "publish", "entries": b})) < wire.MAX_MESSAGE for b in batches)

    assert replica_argv(["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true}', "--seed", "1"]) \
        == ["--model", "m", "--seed", "1"]
    assert replica_argv(['--kv-events-config={"a": 1}', "--seed", "1"]) == ["--seed", "1"]

    import tempfile

    from engine.config import EngineConfig
    from engine.serving.options import ServerOptions
    from engine.serving.dp import replicas
    from engine.serving.dp.replicas import ReplicaSet
    taken = zmq.Context.instance().socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    made = []  # the replica set's pool directory
    real = tempfile.mkdtemp
    monkeypatch.setattr(replicas.tempfile, "mkdtemp", lambda **kw: made.append(real(**kw)) or made[-1])
    config = EngineConfig(model="random:tiny", kv_cache_memory=4 << 20, page_size=65536,
                          kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}"})
    try:
        with pytest.raises(ValueError, match="cannot open"):
            ReplicaSet(ServerOptions(data_parallel_size=2), config, [])
    finally:
        taken.close(linger=0)
    assert made and not os.path.exists(made[0])  # the pool, its socket and its directory gone


def test_under_isolate_clients_a_listener_reads_page_names_but_no_tenants_tokens(tmp_path):
    """The reproducer: a subscriber with no credentials decoded another user's prompt from
    BlockStored.token_ids. A server isolating its clients announces pages by name only (unless
    subscribers must present a CURVE key), and refuses to be told otherwise without one."""
    events = KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/p",
                                "replay_endpoint": f"ipc://{tmp_path}/r"})
    isolated = events.for_tenants(isolated=True)
    assert isolated.token_ids is False and events.for_tenants(isolated=False) is events
    with pytest.raises(ValueError, match="curve_secret_key"):
        KVEventsConfig.of({"enable_kv_cache_events": True, "token_ids": True}).for_tenants(isolated=True)
    secret = "My bank PIN is 4417 and my password is hunter2. " * 6
    with LLM(model=NARROW, kv_cache_memory=POOL, kv_events_config=isolated) as llm:
        prompt = llm.tokenizer.encode(secret)
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "client:alice"}], GREEDY, use_tqdm=False)
        batches = [b for _, b in replay(isolated.replay_endpoint)]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and all(e.token_ids == [] and e.block_hashes and e.block_size > 0 for e in stored)


def test_endpoints_that_cannot_work_or_reach_other_machines_are_refused_by_name():
    for endpoint, says in (("tcp://nohost:99999", "port must be"), ("tcp://no-such-host.invalid:5557", "does not resolve"),
                           ("udp://127.0.0.1:5557", "expected tcp://"), ("tcp://*:5557", "reachable from other machines"),
                           ("tcp://0.0.0.0:5557", "reachable from other machines")):
        with pytest.raises(ValueError, match=says):
            KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": endpoint})
    assert KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "allow_remote": True})
    for field, value in (("enable_kv_cache_events", "yes"), ("buffer_steps", True), ("topic", 3)):
        with pytest.raises(ValueError, match=f"{field} must be"):
            KVEventsConfig.of({"enable_kv_cache_events": True, field: value})


def test_with_curve_keys_only_a_listed_subscriber_reads_the_stream(tmp_path):
    import zmq.auth

    from engine.kv.events import Removed
    from engine.kv.publisher import ZmqEventPublisher
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_public, server_file = zmq.auth.create_certificates(str(keys), "server")
    router_public, router_file = zmq.auth.create_certificates(str(keys), "router")
    stranger_public, stranger_file = zmq.auth.create_certificates(str(keys), "stranger")
    (allowed / "router.key").write_bytes(open(router_public, "rb").read())
    endpoint = f"ipc://{tmp_path}/p"
    pub = ZmqEventPublisher(KVEventsConfig.of({"enable_kv_cache_events": True, "endpoint": endpoint,
                                               "curve_secret_key": server_file, "curve_client_keys": str(allowed)}))

    def subscriber(client_file):
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(client_file)
        sock.curve_serverkey = zmq.auth.load_certificate(server_file)[0]
        sock.connect(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    router, stranger = subscriber(router_file), subscriber(stranger_file)
    try:
        time.sleep(0.5)  # the handshakes (the stranger's refused)
        for i in range(3):
            pub.publish([Removed([bytes([i]) * 32], GPU)])
        assert router.poll(3000) and DECODE.decode(router.recv_multipart()[2]).events
        assert not stranger.poll(500)
    finally:
        router.close(linger=0)
        stranger.close(linger=0)
        pub.close()
