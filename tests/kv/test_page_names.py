"""Prefix pages are named by SHA-256 chained over the parent's name and the page's tokens, from a
root that holds the request's cache_salt: names are the same in every process, cannot be forged
offline, and requests of different salts never share a page."""
import os
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.kv.prefix_cache import chain_hash, root_name
from helpers import assert_pool_whole

PROMPT = list(range(10, 210))  # 200 tokens: 12 whole pages of 16 tokens
ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def test_names_are_sha256_chains_the_same_in_every_process():
    root = root_name()
    first = chain_hash(root, [1, 2, 3])
    assert len(first) == 32 and first != chain_hash(root, [1, 2, 4]) and first != chain_hash(root_name(b"x"), [1, 2, 3])
    assert chain_hash(first, [5]) != chain_hash(chain_hash(root, [1, 2, 4]), [5])  # the parent is part of the name
    assert root_name(cache_salt="a") != root_name(cache_salt="b") != root
    script = "from engine.kv.prefix_cache import chain_hash, root_name; print(chain_hash(root_name(), [1, 2, 3]).hex())"
    for seed in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.stdout.strip() == first.hex(), done.stderr[-500:]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="random:tiny", page_size=4096, kv_cache_memory=4 << 20, max_num_seqs=4)


def hits_after(llm, prompt) -> int:
    before = llm.stats().kv.prefix_cache_hits
    llm.generate([prompt], ONE, use_tqdm=False)
    return llm.stats().kv.prefix_cache_hits - before


def test_requests_share_pages_only_with_the_same_cache_salt(llm):
    assert hits_after(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}) == 0
    assert hits_after(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}) == 0
    assert hits_after(llm, PROMPT) == 0  # no salt: a namespace of its own
    assert hits_after(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-a"}) == 192
    assert hits_after(llm, {"prompt_token_ids": PROMPT, "cache_salt": "tenant-b"}) == 192
    assert hits_after(llm, PROMPT) == 192
    assert_pool_whole(llm)


@pytest.mark.parametrize("bad", [{"prompt_token_ids": PROMPT, "cache_salt": ""},
                                 {"prompt_token_ids": PROMPT, "cache_salt": 7},
                                 {"prompt_token_ids": PROMPT, "salt": "x"},
                                 {"prompt": "hi", "prompt_token_ids": PROMPT},
                                 {"cache_salt": "x"}])
def test_bad_prompt_dicts_are_refused_by_name(llm, bad):
    with pytest.raises(ValueError, match="cache_salt|prompt"):
        llm.generate([bad], ONE, use_tqdm=False)
