"""Fault injection at every OS call of the KV disk tier, in the manner of SQLite's I/O-error tests.

Each method of engine.kv.disk_tier.FileSystem (every OS call the tier makes) fails in turn with each
errno class, every time it is called or only on its n-th call; then files are swapped for a FIFO,
a directory or a symlink out of the directory between the scan and the read; and reads come back
short; and adapter loading's reads fail the same ways. After each: no engine death, no hang (the test's timeout), greedy output equal to the
tier-less run, the pool audit whole, and a restarted engine over the same directory starts. The
count of faults injected and survived is printed."""
import errno
import os
from pathlib import Path

import pytest
import torch
from helpers import assert_pool_whole

from engine import LLM, SamplingParams
from engine.kv import disk_tier as tiers
from engine.kv.disk_tier import FileSystem

# random:tiny (512 bytes of KV per token) in 4 KiB pages: a pool of 24 pages holds one of the
# prompts, so each round evicts the others to the disk tier and restores them from it.
PROMPTS = [[3 + i] * 8 + [(7 * i + j) % 200 + 5 for j in range(90)] for i in range(3)]
OPTIONS = dict(model="random:tiny", kv_cache_memory=24 * 4096, page_size=4096, max_num_seqs=1)
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
DISK_GIB = 8 * 16496 / (1 << 30)  # eight entries' files: writes past them trim (unlink) the oldest
ERRNOS = (errno.EIO, errno.ENOSPC, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP, errno.ENOENT)
CALLS = [name for name in vars(FileSystem) if not name.startswith("_") and callable(getattr(FileSystem, name))]


def run(llm) -> list[list[int]]:
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference():
    with LLM(**OPTIONS) as llm:
        return run(llm)


class Faults:
    """Makes one FileSystem call fail (every time, or only its n-th time) with an errno."""

    def __init__(self, monkeypatch, call: str, code: int, nth: int | None = None):
        self.injected, self.seen = 0, 0
        real = getattr(tiers.FS, call)

        def failing(*args):
            self.seen += 1
            if nth is None or self.seen == nth:
                self.injected += 1
                raise OSError(code, os.strerror(code))
            return real(*args)
        monkeypatch.setattr(tiers.FS, call, failing)


def two_engines(tmp_path, reference) -> None:
    """One engine fills the directory (evictions, trims past its byte bound, then its close), a
    second restores from it; both give the tier-less tokens and leave the pool whole."""
    options = dict(OPTIONS, kv_offloading_path=str(tmp_path), kv_offloading_path_size=DISK_GIB)
    for _ in range(2):
        with LLM(**options) as llm:
            assert run(llm) == reference and run(llm) == reference
            assert_pool_whole(llm)


@pytest.mark.parametrize("call", CALLS)
def test_every_os_call_failing_with_every_errno_is_survived(tmp_path, monkeypatch, reference, call):
    injected = 0
    for code in ERRNOS:
        with monkeypatch.context() as patch:
            faults = Faults(patch, call, code)
            two_engines(tmp_path / str(code), reference)
        injected += faults.injected
    print(f"{call}: {injected} faults injected over {len(ERRNOS)} errnos: 0 engine deaths, 0 hangs")
    assert injected >= len(ERRNOS)  # every call is reached, under every errno


@pytest.mark.parametrize("call", ["open", "readinto", "write", "replace", "unlink", "fstat", "scandir"])
def test_one_failure_at_each_point_of_a_run(tmp_path, monkeypatch, reference, call):
    """The n-th call fails once (EIO), for n through the run: a failure at each point of it."""
    injected = 0
    for nth in (1, 2, 3, 5, 8, 13, 21, 34):
        with monkeypatch.context() as patch:
            faults = Faults(patch, call, errno.EIO, nth)
            two_engines(tmp_path / str(nth), reference)
        injected += faults.injected
        if not faults.injected:  # the run no longer reaches an n-th call
            break
    print(f"{call}: {injected} single faults injected and survived")
    assert injected >= 2


def test_a_tier_that_keeps_failing_turns_itself_off_and_the_engine_serves(tmp_path, monkeypatch, reference):
    with monkeypatch.context() as patch:
        Faults(patch, "open", errno.EROFS)
        with LLM(**OPTIONS, kv_offloading_path=str(tmp_path)) as llm:
            for _ in range(12):
                assert run(llm) == reference
            disk = llm.stats().kv.tiers[0]
            assert disk.off and dict(disk.errors_by)[("open", "EROFS")] >= tiers.FAILURES_TO_TURN_OFF
            assert_pool_whole(llm)


def written(tmp_path) -> list:
    with LLM(**OPTIONS, kv_offloading_path=str(tmp_path)) as llm:
        run(llm)
    files = sorted(tmp_path.glob("*/*.kv"))
    assert len(files) >= 6
    return files


@pytest.mark.parametrize("swap", ["fifo", "directory", "symlink out", "dangling symlink", "short read"])
def test_files_swapped_between_the_scan_and_the_read_are_dropped(tmp_path, monkeypatch, reference, swap):
    files = written(tmp_path)
    outside, secret = tmp_path / "secret", b"x" * files[0].stat().st_size
    outside.write_bytes(secret)
    with LLM(**OPTIONS, kv_offloading_path=str(tmp_path)) as llm:  # scanned: every file indexed
        for f in files:
            if swap != "short read":
                f.unlink()
            if swap == "fifo":
                os.mkfifo(f)
            elif swap == "directory":
                f.mkdir()
            elif swap == "symlink out":
                f.symlink_to(outside)
            elif swap == "dangling symlink":
                f.symlink_to(tmp_path / "nothing")
        if swap == "short read":
            real = tiers.FS.readinto
            monkeypatch.setattr(tiers.FS, "readinto", lambda fd, buf: real(fd, buf[:100]) if len(buf) > 100 else 0)
        assert run(llm) == reference and run(llm) == reference
        disk = llm.stats().kv.tiers[0]
        assert disk.errors >= 1, disk  # found and dropped (what is restored now, this engine wrote since)
        assert_pool_whole(llm)
    monkeypatch.undo()
    if swap in ("fifo", "directory", "symlink out"):
        assert all(f.exists() or f.is_symlink() for f in files)  # not ours: left alone, never followed or removed
    with LLM(**OPTIONS, kv_offloading_path=str(tmp_path)) as llm:  # and a restart over them starts
        assert run(llm) == reference
    assert outside.read_bytes() == secret  # never written through


def test_namespace_file_is_never_written_through_a_link(tmp_path, reference):
    with LLM(**OPTIONS, kv_offloading_path=str(tmp_path)) as llm:
        run(llm)
    (directory,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    meta = directory / "namespace.json"
    meta.unlink()
    target = tmp_path / "elsewhere.json"
    meta.symlink_to(target)  # dangling: writing through it would create `target`
    with LLM(**OPTIONS, kv_offloading_path=str(tmp_path)) as llm:
        assert run(llm) == reference
    assert not target.exists() and meta.is_symlink()


def test_adapter_files_that_fail_to_read_are_refused_by_name(tmp_path, monkeypatch):
    """Adapter loading (engine/worker/lora.py) under the same errno classes: every read of its files
    failing gives a ValueError naming the adapter (a 400 on the server), never another error."""
    from safetensors.torch import save_file

    from engine.request.lora_request import LoRARequest
    from engine.worker.lora import load_adapter
    from engine.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    path = tmp_path / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4}')
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 16),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(16, 2)},
              str(path / "adapter_model.safetensors"))
    request = LoRARequest("a", 1, str(path))
    assert load_adapter(request, cfg, 8, torch.device("cpu"), torch.float32).rank == 2
    injected = 0
    for target in ("open", "read_bytes"):
        for code in ERRNOS:
            def failing(*args, **kwargs):
                nonlocal injected
                injected += 1
                raise OSError(code, os.strerror(code))
            with monkeypatch.context() as patch:
                if target == "open":
                    patch.setattr("builtins.open", failing)
                else:
                    patch.setattr(Path, "read_bytes", failing)
                with pytest.raises(ValueError, match=r"LoRA adapter 'a' .*cannot be read"):
                    load_adapter(request, cfg, 8, torch.device("cpu"), torch.float32)
    print(f"adapter loading: {injected} faults injected, each refused by name")
    assert injected == 2 * len(ERRNOS)
