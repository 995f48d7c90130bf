"""Lookup alone, over a real layout and prefix cache: a sequence's page names, the prefix admit
finds (never its last prompt token's page, whose logits are wanted), what cached_prefix predicts,
and a hit that ends inside a page, copied into a page of the sequence's own."""
import torch

import vmm
from engine.kv.manager import KVManager
from engine.kv.prefix_cache import chain_hash
from engine.kv.virtual import VirtualLayout
from engine.models.config import ModelConfig
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence

CFG = ModelConfig(vocab_size=64, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                  head_dim=64)  # per_layer: 512 bytes a token a region, 8 tokens a 4 KiB page


def manager() -> KVManager:
    layout = VirtualLayout(CFG, "per_layer", 4, 128, torch.float32, vmm.HostBackend(4096), 64)
    return KVManager(layout, prefix_caching=True)


def seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingParams(max_tokens=4), 0.0, cache_salt=salt)


def run(kv: KVManager, s: Sequence) -> None:
    """Admit s, compute its whole prompt (its rows written), commit its pages."""
    s.num_computed_tokens = kv.admit(s)
    assert kv.ensure_mapped(s, len(s))
    s.num_computed_tokens = len(s)
    kv.commit(s)


def test_names_chain_from_the_root_page_by_page():
    kv = manager()
    s = seq(list(range(1, 21)))  # two whole pages of 8, and 4 tokens
    names = kv.lookup.names(s)
    assert len(names) == 2 and kv.layout.page_end(0) == 8
    root = kv.lookup.root(s)
    assert names == [chain_hash(root, list(range(1, 9))), chain_hash(chain_hash(root, list(range(1, 9))),
                                                                     list(range(9, 17)))]
    assert kv.lookup.root(seq([1], salt="a")) != root
    kv.close()


def test_admit_finds_the_cached_pages_but_computes_the_last_prompt_token():
    kv = manager()
    first = seq(list(range(1, 21)))
    run(kv, first)
    kv.release(first)
    assert kv.cached_prefix(seq(list(range(1, 21))))[1] == 2
    again = seq(list(range(1, 17)))  # exactly two pages: the second holds its last token
    assert kv.admit(again) == 15  # the first page mapped, the second's first 7 rows copied: the 16th computed
    assert kv.prefix_cache.hits == 15 and kv.lookup.partial_tokens == 7  # hits count the copied rows too
    assert not kv.layout.is_shared(again, 1)
    kv.release(again)
    other = seq(list(range(1, 17)), salt="tenant-b")  # another salt: nothing shared
    assert kv.cached_prefix(other)[1] == 0 and kv.admit(other) == 0
    kv.release(other)
    kv.audit()
    kv.close()


def test_a_hit_that_ends_inside_a_page_copies_its_rows_into_a_private_page():
    kv = manager()
    first = seq(list(range(1, 21)))
    run(kv, first)
    kv.release(first)
    shorter = seq(list(range(1, 12)) + [60, 61])  # page 2 would begin 9, 10, 11: three rows a hit
    held = kv.admit(shorter)
    assert held == 11 and kv.lookup.partial_tokens == 3
    page = kv.layout.pages_at(shorter, 1)
    assert page is not None and not kv.layout.is_shared(shorter, 1)  # its own: it writes row 11 next
    kv.release(shorter)
    kv.audit()
    kv.close()
