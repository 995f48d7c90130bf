"""The tokenizer a model is served with: its checkpoint's own, loaded as AutoTokenizer loads it.

Note [The tokenizer's class, remembered]
Rationale: AutoTokenizer picks a directory's tokenizer class from its files, and to pick it builds
the model's config through transformers' config class for its model type, whose import brings in
torch.distributed.tensor: 2.3 s of a process's ~7 s start (2 Zen 1 cores), paid by every `vkv
serve`, replica and tensor-parallel rank, for one class name (for the bundled model,
TokenizersBackend, whose own load takes 0.35 s).

Approach: the first load of a directory asks AutoTokenizer and remembers the class it returned
(a DiskMemo, Note [Facts remembered across processes]); a later load calls that class's
from_pretrained, which is how AutoTokenizer itself ends. The key holds everything the choice
reads: transformers' version, the directory's path (AutoTokenizer matches some model names in
it) and a digest of each of its files but the weights (configs, tokenizer.json, templates,
vocabularies).

Limitations: a directory whose tokenizer is its own code (`auto_map` in tokenizer_config.json)
or whose class lives outside transformers is never remembered: AutoTokenizer and its trust checks
load it each time. A class that can no longer be imported is asked of AutoTokenizer again.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from pathlib import Path

from engine.models.disk_memo import DiskMemo
from engine.models.loader import cache_root, checkpoint_dir

log = logging.getLogger("vkv.models")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx")
MAX_READ = 256 << 20  # a file the tokenizer could read, at most (tokenizer.json of large vocabularies: ~20 MB)


def load_tokenizer(spec: str | None):
    """The checkpoint's own tokenizer; random models and bare checkpoints borrow one: the
    directory $VKV_TOKENIZER names (a tokenizer.json beside its tokenizer_config.json, for a
    machine without the bundled model's package, a GPU box running random models), else the
    bundled model's."""
    path = checkpoint_dir(spec)
    if path is None or not _has_tokenizer(path):
        borrowed = os.environ.get("VKV_TOKENIZER")
        if path is not None:  # said: a checkpoint of another vocabulary would decode to wrong text
            log.warning("vkv: %s has no tokenizer files: borrowing %s's", path, borrowed or "the bundled model")
        path = Path(borrowed).expanduser() if borrowed else checkpoint_dir(None)
        if borrowed and not _has_tokenizer(path):
            raise FileNotFoundError(f"VKV_TOKENIZER={borrowed}: no tokenizer.json or tokenizer_config.json there")
    return tokenizer_at(path)


def tokenizer_at(path: Path):
    """AutoTokenizer.from_pretrained(path), through the class it chose before for these files."""
    import transformers

    memo = DiskMemo(cache_root() / "tokenizer-classes.json")
    key = _key(path, transformers.__version__)
    known = memo.get(key) if key else None
    if known:
        try:
            module, name = known.split(":")
            return getattr(importlib.import_module(module), name).from_pretrained(path, _from_auto=True)
        except (ImportError, AttributeError, ValueError) as exc:
            log.debug("vkv: the remembered tokenizer class %s did not load (%s): asking AutoTokenizer", known, exc)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    cls = type(tokenizer)
    if key and cls.__module__.startswith("transformers."):
        memo.put(key, f"{cls.__module__}:{cls.__qualname__}")
    return tokenizer


def _key(path: Path, version: str) -> str | None:
    """What AutoTokenizer's choice of class depends on, hashed; None where the choice is left to
    it every time (the tokenizer is the checkpoint's own code, or a file cannot be read)."""
    h = hashlib.sha256(f"vkv/tokenizer-class/v1\0{version}\0{path.resolve()}\0".encode())
    try:
        for name in ("tokenizer_config.json", "config.json"):
            config = json.loads((path / name).read_text()) if (path / name).is_file() else {}
            if not isinstance(config, dict) or "auto_map" in config:
                return None
        for f in sorted(path.iterdir()):
            if not f.is_file() or f.suffix in WEIGHT_SUFFIXES:
                continue
            if f.stat().st_size > MAX_READ:
                return None
            h.update(f.name.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    except (OSError, ValueError):
        return None
    return h.hexdigest()


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
