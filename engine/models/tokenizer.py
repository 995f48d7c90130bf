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
reads: the versions of transformers and of the packages whose presence changes it (tokenizers,
sentencepiece, mistral_common, protobuf), the directory's path as given and resolved
(AutoTokenizer matches some model names in the path as given) and a digest of each of its files
but the weights (configs, tokenizer.json, templates, vocabularies). A remembered name is used
only if it names a tokenizer class of transformers' own.

Limitations: a directory whose tokenizer is its own code (`auto_map` in tokenizer_config.json)
or whose class lives outside transformers is never remembered: AutoTokenizer and its trust checks
load it each time. A class that can no longer be imported is asked of AutoTokenizer again.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
from pathlib import Path

from engine.models.disk_memo import DiskMemo
from engine.models.loader import _file_sha256, cache_root, model_dir

log = logging.getLogger("vkv.models")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npz",
                   ".npy", ".ot")
CHOICE_PACKAGES = ("transformers", "tokenizers", "sentencepiece", "mistral_common", "protobuf")
MAX_READ = 256 << 20  # a file the tokenizer could read, at most (tokenizer.json of large vocabularies: ~20 MB)


def load_tokenizer(spec: str | None):
    """The checkpoint's own tokenizer; random models and bare checkpoints borrow one: the
    directory $VKV_TOKENIZER names (a tokenizer.json beside its tokenizer_config.json, for a
    machine without the bundled model's package, a GPU box running random models), else the
    bundled model's."""
    path = model_dir(spec)
    if path is None or not _has_tokenizer(path):
        borrowed = os.environ.get("VKV_TOKENIZER")
        if path is not None:  # said: a checkpoint of another vocabulary would decode to wrong text
            log.warning("vkv: %s has no tokenizer files: borrowing %s's", path, borrowed or "the bundled model")
        path = Path(borrowed).expanduser() if borrowed else model_dir(None)
        if borrowed and not _has_tokenizer(path):
            raise FileNotFoundError(f"VKV_TOKENIZER={borrowed}: no tokenizer.json or tokenizer_config.json there")
    return tokenizer_at(path)


def tokenizer_at(path: Path):
    """AutoTokenizer.from_pretrained(path), through the class it chose before for these files."""
    import transformers

    memo = DiskMemo(cache_root() / "tokenizer-classes.json")
    key = _key(path)
    known = memo.get(key) if key else None
    cls = _tokenizer_class(known) if known else None
    if cls is not None:
        return cls.from_pretrained(path, _from_auto=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    cls = type(tokenizer)
    if key and cls.__module__.startswith("transformers."):
        memo.put(key, f"{cls.__module__}:{cls.__qualname__}")
    return tokenizer


def _tokenizer_class(known: str):
    """The class a memo's entry names, if it is one of transformers' tokenizer classes (the memo's
    file is only the user's cache: an entry naming anything else is ignored); else None."""
    from transformers import PreTrainedTokenizerBase

    module, _, name = known.partition(":")
    if not module.startswith("transformers."):
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        log.debug("vkv: the remembered tokenizer class %s does not load (%s): asking AutoTokenizer", known, exc)
        return None
    return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None


def _key(path: Path) -> str | None:
    """What AutoTokenizer's choice of class depends on, hashed; None where the choice is left to
    it every time (the tokenizer is the checkpoint's own code, or a file cannot be read)."""
    versions = "\0".join(f"{p}={_version(p)}" for p in CHOICE_PACKAGES)
    h = hashlib.sha256(f"vkv/tokenizer-class/v2\0{versions}\0{os.fspath(path)}\0{path.resolve()}\0".encode())
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
            h.update(f.name.encode() + b"\0" + _file_sha256(f))  # (remembered: a process's next engine reads none)
    except (OSError, ValueError):
        return None
    return h.hexdigest()


@functools.cache  # (as transformers caches which packages it found)
def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
