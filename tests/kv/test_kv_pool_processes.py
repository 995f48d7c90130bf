"""Engine processes over one physical KV pool (--kv-pool, vmm/owner.py): a prompt prefilled in
one process is not computed again in another, which maps the first one's pages in place; the
outputs equal a process of its own's; a process killed mid-life gives its pages back."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from conftest import BACKENDS, make_cuda_backend
from helpers import TESTS, child_env

CUDA_KIND = BACKENDS[1]
from vmm import HostBackend, PoolOwner, cuda_unavailable_reason

HELPER = TESTS / "engine_process.py"


def start(sock, layout, prompt):
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(HELPER), sock, layout, json.dumps(prompt)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def result(proc) -> dict:
    line = proc.stdout.readline()
    assert line, "the engine process died"
    return json.loads(line)


@pytest.mark.parametrize("layout", ["per_layer", "interleaved"])
def test_a_prefix_computed_in_one_process_is_mapped_in_another_and_outputs_equal(tmp_path, layout):
    owner = PoolOwner(HostBackend(64 << 10), 1024, str(tmp_path / "pool.sock")).start()
    prompt = random.Random(0).sample(range(100, 5000), 300)
    alone = start("-", layout, prompt)  # a process with a pool of its own: the reference
    first = start(owner.path, layout, prompt)
    procs = [alone, first]
    try:
        reference, a = result(alone), result(first)
        assert a["tokens"] == reference["tokens"] and a["imported"] == 0
        second = start(owner.path, layout, prompt)
        procs.append(second)
        b = result(second)
        assert b["tokens"] == reference["tokens"]
        assert b["imported"] > 0 and b["hits"] >= 255, b  # every whole page but the last token's: mapped, not computed
        owner.audit()
        killed = time.monotonic()
        os.kill(first.pid, signal.SIGKILL)
        while len(owner.held) > 1:
            assert time.monotonic() - killed < 1.0, "the killed process's references are still held"
            time.sleep(0.005)
        owner.audit()
        second.stdin.write("\n")
        second.stdin.flush()
        assert second.stdout.readline().strip() == "audited"  # its own count still equals its mappings
        second.wait(timeout=30)
        owner.audit()
        assert owner.stats()["held"] == {} and owner.pool.num_free + owner.stats()["cached"] == 1024
    finally:
        for p in procs:
            p.kill()
            p.wait()
        owner.stop()


def test_pages_taken_by_another_process_between_check_and_alloc_leave_the_step_unmapped_not_dead(tmp_path):
    """The room a process saw can be taken by another before it allocates: the step gets False
    (the scheduler preempts or waits), nothing is left half mapped, and no exception kills it."""
    import torch

    from engine.kv.manager import KVManager
    from engine.kv.virtual import VirtualLayout
    from engine.models import load_config
    from engine.request.sampling_params import SamplingParams
    from engine.request.sequence import Sequence
    from vmm import AttachedPool

    owner = PoolOwner(HostBackend(64 << 10), 64, str(tmp_path / "pool.sock")).start()
    mine, other = AttachedPool(owner.path), AttachedPool(owner.path)
    kv = KVManager(VirtualLayout(load_config("random:smollm2-kv"), "per_layer", 2, 256, torch.float32, mine.backend,
                                 mine.num_pages, 1, None, mine), True)
    try:
        seq = Sequence("s", 0, list(range(1, 51)), SamplingParams(max_tokens=1), 0.0)  # one page per region: 60
        kv.admit(seq)
        kv._make_room = lambda need: True  # it saw room ...
        taken = other.alloc_many(64 - 30)  # ... which the other process took first: 30 left, 60 needed
        assert kv.ensure_mapped(seq, 50) is False
        kv.audit()
        assert owner.pool.num_free == 30
        other.drop_many(taken)
        assert kv.ensure_mapped(seq, 50) is True
        kv.release(seq)
        kv.audit()
        owner.audit()
    finally:
        kv.close()
        other.close()
        owner.stop()


def test_a_swap_in_whose_room_another_process_took_part_way_goes_on_later_with_its_bytes(tmp_path):
    """The same race in the middle of a swap-in: the pages that came back stay mapped, the rest
    stay swapped (no swap slot freed twice), the step gets False, and a later try brings the
    rest back with the bytes they had."""
    import torch

    from engine.kv.manager import KVManager
    from engine.kv.virtual import VirtualLayout
    from engine.models.config import ModelConfig
    from engine.request.sampling_params import SamplingParams
    from engine.request.sequence import Sequence
    from vmm import AttachedPool, SwapSpace

    cfg = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=3, num_kv_heads=3,
                      head_dim=40)  # 34 tokens a 64 KiB page of both layers' K and V
    owner = PoolOwner(HostBackend(64 << 10), 64, str(tmp_path / "pool.sock")).start()
    mine, other = AttachedPool(owner.path), AttachedPool(owner.path)
    swap = SwapSpace(mine.backend, 32 * (64 << 10))
    layout = VirtualLayout(cfg, "interleaved", 4, 256, torch.float32, mine.backend, mine.num_pages, 1, swap, mine)
    kv = KVManager(layout, True)
    try:
        seq = Sequence("s", 0, list(range(1, 121)), SamplingParams(max_tokens=1), 0.0)
        kv.admit(seq)
        assert kv.ensure_mapped(seq, 110)
        seq.num_computed_tokens = 110
        rows = layout.k_caches[1][seq.kv.slot, :110]
        rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(0)))
        expected = rows.clone()
        assert kv.swap_out(seq)
        pages = len(layout.swapped_pages(seq))
        assert pages >= 2
        room = kv._make_room
        taken = []

        def racing(need):  # room seen, then all but one page's worth taken by the other process
            ok = room(need)
            taken.extend(other.alloc_many(mine.num_free - layout.num_regions))
            return ok

        kv._make_room = racing
        assert kv.swap_in(seq, 111) is False
        assert 0 < len(layout.swapped_pages(seq)) < pages
        kv.audit()
        del kv._make_room
        other.drop_many(taken)
        assert kv.swap_in(seq, 111) is True
        assert seq.kv.swapped is None
        assert torch.equal(layout.k_caches[1][seq.kv.slot, :110], expected)
        kv.release(seq)
        kv.audit()
        assert swap.num_free == swap.num_slots
        owner.audit()
    finally:
        kv.close()
        other.close()
        owner.stop()


@pytest.mark.parametrize("kind, layout, length, reader", [
    ("host", "per_layer", 200, False), ("host", "interleaved", 200, False), (CUDA_KIND, "per_layer", 200, False),
    (CUDA_KIND, "interleaved", 200, False),
    ("host", "per_layer", 256, False),  # 256: the prompt ends where its 3rd page ends
    ("host", "per_layer", 256, True)])  # ... and a third process maps that page meanwhile
def test_a_prefilled_prompt_is_handed_over_by_mapping_its_pages(tmp_path, kind, layout, length, reader):
    """The prefill-to-decode handoff between two caches over one pool (each its own connection
    to the owner, as two processes are): the decoding cache maps every whole page the prefilling
    one computed and takes the last (partial, or whole where the prompt ends at its end): it
    leaves the directory for the decoder alone, which writes its last rows in place, so nothing
    is copied; only the prompt's last token is computed again; the K and V rows read are
    exactly those written. A whole last page that another process maps stays cached for all:
    the decoder copies the rows it needs out of it. Over host pages and over CUDA pages exported by the owner and imported by each cache's pool
    (vkv's CudaBackend; the driver emulator without a GPU); at the end every handle, mapping
    and range is given back."""
    import torch

    from engine.kv.manager import KVManager
    from engine.kv.virtual import VirtualLayout
    from engine.models import load_config
    from engine.request.sampling_params import SamplingParams
    from engine.request.sequence import Sequence
    from vmm import AttachedPool

    cuda = kind != "host"
    host_page = (64 << 10) if layout == "per_layer" else (2 << 20)  # pages of 85 and of 45 tokens
    owner = PoolOwner(make_cuda_backend(shareable=True) if cuda else HostBackend(host_page),
                      1024 if host_page < (2 << 20) and not cuda else 128, str(tmp_path / "pool.sock")).start()
    caches = []
    try:
        for _ in range(3):  # the prefilling process's cache, the decoding one's, another's
            pool = AttachedPool(owner.path, make_cuda_backend() if cuda else None)
            caches.append(KVManager(VirtualLayout(load_config("random:smollm2-kv"), layout, 2, 512, torch.float32,
                                                  pool.backend, pool.num_pages, 1, None, pool), True))
        prefiller, decoder, other = caches
        tokens = random.Random(1).sample(range(100, 5000), length)
        pages = prefiller.layout.page_range(0, len(tokens))
        assert (prefiller.layout.page_end(pages[-1]) > len(tokens)) == (length == 200)  # inside its last page, or at its end
        seq = Sequence("p", 0, tokens, SamplingParams(max_tokens=1), 0.0)
        prefiller.admit(seq)
        assert prefiller.ensure_mapped(seq, len(tokens))
        for k in pages:
            for r, view in enumerate(prefiller.layout.page_views(seq, k)):
                view.copy_(torch.full_like(view, (1 + k * 7 + r) % 256))
        seq.num_computed_tokens = len(tokens)
        prefiller.commit(seq)
        n = len(tokens) - 1  # the rows the decoding side takes: all but the last token's
        written = [rows[seq.kv.slot, :n].view(torch.int32).clone() for rows in prefiller.layout.k_caches + prefiller.layout.v_caches]
        prefiller.release(seq)  # the prefill is done: its last, partial page is published too
        if reader:  # a longer prompt maps every page of this one, the last included
            longer = Sequence("o", 0, tokens + [7] * 10, SamplingParams(max_tokens=1), 0.0)
            assert other.admit(longer) == len(tokens)
        taken = Sequence("d", 0, tokens, SamplingParams(max_tokens=1), 0.0)
        assert decoder.admit(taken) == n  # the last token is computed again: its logits are wanted
        if not reader:  # every page mapped, the last one (partial, or whole where the prompt ends at
            # its end) taken: out of the directory, the decoding cache its one holder, nothing copied
            assert decoder.stats().prefix_cache_imported == len(pages) * decoder.layout.num_regions
            assert decoder.stats().prefix_cache_partial_bytes == 0
            assert owner.stats()["named"] == len(pages) - 1
        else:  # the last page stays cached for all: the rows needed are copied out of it
            assert decoder.stats().prefix_cache_partial_bytes == \
                (n * decoder.layout.row_bytes - (len(pages) - 1) * decoder.layout.page_size) * decoder.layout.num_regions
            assert owner.stats()["named"] == len(pages)
            other.release(longer)
        read = [rows[taken.kv.slot, :n].view(torch.int32) for rows in decoder.layout.k_caches + decoder.layout.v_caches]
        assert all(torch.equal(a, b) for a, b in zip(read, written))
        decoder.release(taken)
        for kv in caches:
            kv.audit()
        owner.audit()
    finally:
        for kv in caches:
            kv.close()
        owner.stop()
    if cuda and cuda_unavailable_reason() is not None:  # the driver emulator counts what is left: nothing
        from cuda_emulator import counts
        c = counts()
        assert c.allocations == c.reservations == c.mappings == 0
