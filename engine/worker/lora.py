"""Many LoRA adapters over one base model, in one batch (vLLM's API, S-LoRA / Punica's idea).

Rationale. One machine serves many customers' fine-tunes of the same base model. Merging an
adapter into the weights serves one adapter at a time; keeping the base weights once and
adding each row's low-rank delta lets a step hold rows of any adapters and of the base.

Approach. A projection y = x W^T gains, for a row of adapter a, x A_a^T B_a^T * scaling_a
(PEFT's LoRA, rank r: A is [r, in], B is [out, r]). The model runner orders a step's
sequences by adapter, so each adapter's rows are one contiguous segment; every adapted
projection adds two small GEMMs per segment over its rows (Punica's SGMV, written with torch
ops). Base-model rows cost nothing. A sequence's page names chain from a root that holds its
adapter's digest (a SHA-256 of its config and weights), so two adapters never share a cached
page, a disk tier never restores one adapter's KV for another, and base-model requests share
with each other as before.

Implementation.
  LoRARequest  what a request names (vLLM's: lora_name, lora_int_id, lora_path)
  load_adapter a PEFT checkpoint read and checked against the model (adapter_config.json +
               adapter_model.safetensors or .bin); q/k/v and gate/up are fused as the model
               fuses them: their A's are stacked, their B's placed block-diagonally, with each
               part's scaling folded into its B
  LoRARegistry the adapters in memory, at most max_cpu_loras, least recently used dropped
               first; thread-safe, since a server resolves requests off the engine's thread.
               A sequence holds its Adapter, so dropping one never pulls it from under a
               request in flight
  LoRABatch    a step's segments; `add(layer, module, x, out)` adds the deltas to out
The scheduler runs sequences of at most max_loras distinct adapters at once (vLLM's meaning).

Limitations. LoRA on the embeddings or the LM head, DoRA, biases, modules_to_save and
alpha_pattern are refused by name, as is tensor parallelism with adapters. The segment loop
is Python: its cost grows with the number of distinct adapters in a step (measured in
benchmarks/bench_lora.py), where Punica's kernel pays once.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.config import ModelConfig
from engine.request.lora_request import LoRARequest

# PEFT's module name -> (the model's fused projection, which part of it)
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; PEFT's largest are a few KiB
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(eq=False)
class Adapter:
    """An adapter in memory: per layer, {fused projection: (A [R, in], (B * scaling)^T [R, out])}."""
    name: str
    path: str
    rank: int  # the largest rank of its modules
    digest: bytes  # SHA-256 of its config and weights: its pages' names chain from it
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.weights for ab in layer.values() for t in ab)


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Per fused projection: its input features and its parts' output features."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": (cfg.hidden_size, [q, kv, kv]), "o_proj": (q, [cfg.hidden_size]),
            "gate_up_proj": (cfg.hidden_size, [cfg.intermediate_size] * 2),
            "down_proj": (cfg.intermediate_size, [cfg.hidden_size])}


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> Adapter:
    """The PEFT checkpoint at request.lora_path, checked against the model; ValueError naming
    what does not fit (a missing file, a rank above max_rank, a module the model lacks, a
    shape from another base model, a PEFT feature vkv does not run)."""
    name = request.lora_name
    try:
        path = Path(request.lora_path).expanduser()
    except RuntimeError:  # "~user" of no user
        raise ValueError(f"LoRA adapter {name!r}: lora_path {request.lora_path!r} names no home directory") from None
    what = f"LoRA adapter {name!r} ({path})"
    try:
        config_bytes = _read_bounded(path / "adapter_config.json", MAX_CONFIG_BYTES)
        if config_bytes is None:
            raise ValueError(f"{what}: no adapter_config.json there")
        if len(config_bytes) > MAX_CONFIG_BYTES:
            raise ValueError(f"{what}: adapter_config.json is over {MAX_CONFIG_BYTES} bytes")
        try:
            config = json.loads(config_bytes)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{what}: adapter_config.json is not JSON, or nested too deep ({exc})") from None
        _check_config(what, config)
        tensors, weight_bytes = _read_weights(what, path, most_bytes(cfg, max_rank))
    except OSError as exc:  # a directory that cannot be read, a name too long, ...
        raise ValueError(f"{what}: cannot be read ({exc.strerror or exc})") from None
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    parts: dict[tuple[int, str], dict[int, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = KEY.match(key)
        if not match:
            raise ValueError(f"{what}: tensor {key!r} is not a LoRA weight of a decoder layer's projection "
                             f"(LoRA on embeddings or the LM head is not supported)")
        layer, module, ab = int(match[1]), match[2], match[3]
        if module not in TARGETS:
            raise ValueError(f"{what}: target module {module!r} is not one this {cfg.model_type} model has "
                             f"(it has {', '.join(TARGETS)})")
        if layer >= cfg.num_layers:
            raise ValueError(f"{what}: targets layer {layer}, the model has {cfg.num_layers}")
        fused, part = TARGETS[module]
        parts.setdefault((layer, fused), {}).setdefault(part, {})[ab] = tensor
    if not parts:
        raise ValueError(f"{what}: the checkpoint holds no LoRA weights")
    shapes, rank = projection_shapes(cfg), 0
    weights: list[dict] = [{} for _ in range(cfg.num_layers)]
    for (layer, fused), by_part in sorted(parts.items()):
        fan_in, outs = shapes[fused]
        a_rows, b_blocks = [], []
        for part, ab in sorted(by_part.items()):
            module = next(m for m, t in TARGETS.items() if t == (fused, part))
            where = f"layers.{layer}.{module}"
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{what}: {where} has lora_{''.join(ab)} without its pair")
            a, b = ab["A"], ab["B"]
            if not (a.is_floating_point() and b.is_floating_point() and torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise ValueError(f"{what}: {where} holds values that are not finite floats")
            r = a.shape[0] if a.dim() == 2 else 0
            if r < 1 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (outs[part], r):
                raise ValueError(f"{what}: {where} has lora_A {list(a.shape)} and lora_B {list(b.shape)}; this model's "
                                 f"{module} maps {fan_in} -> {outs[part]} features (an adapter of another base model?)")
            if r > max_rank:
                raise ValueError(f"{what}: rank {r} ({where}) exceeds max_lora_rank {max_rank}")
            rank = max(rank, r)
            scaling = alpha / (r ** 0.5 if rslora else r)
            a_rows.append(a.double())
            b_blocks.append((sum(outs[:part]), b.double() * scaling))
        a_all = torch.cat(a_rows)  # [R, in]: the parts' A stacked
        b_all = torch.zeros(sum(outs), a_all.shape[0], dtype=torch.float64)  # block-diagonal
        col = 0
        for offset, b in b_blocks:
            b_all[offset:offset + b.shape[0], col:col + b.shape[1]] = b
            col += b.shape[1]
        weights[layer][fused] = (a_all.to(device, dtype).contiguous(), b_all.t().to(device, dtype).contiguous())
    if config.get("r", 8) > max_rank:
        raise ValueError(f"{what}: rank {config['r']} (adapter_config.json's r) exceeds max_lora_rank {max_rank}")
    digest = hashlib.sha256(b"vkv/lora/v1" + len(config_bytes).to_bytes(8, "little") + config_bytes + weight_bytes)
    return Adapter(name, str(path), rank, digest.digest(), weights)


def _read_bounded(path: Path, limit: int) -> bytes | None:
    """A regular file's bytes, at most limit + 1 of them (None when it is not there)."""
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        return f.read(limit + 1)


def _number(value) -> bool:
    """A finite JSON number (an integer of 400 digits is none: float() overflows)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def most_bytes(cfg: ModelConfig, max_rank: int) -> int:
    """The most bytes an adapter's weights can take (every projection of every layer at
    max_lora_rank, in fp64), and room for the file's header: a larger file is refused unread."""
    per_layer = sum(fan_in + sum(outs) * len(outs) for fan_in, outs in projection_shapes(cfg).values())
    return cfg.num_layers * per_layer * max_rank * 8 * 4 + (1 << 20)


def _check_config(what: str, config) -> None:
    """adapter_config.json against PEFT's LoraConfig: an object; r an integer >= 1 (at most
    max_lora_rank: checked with the weights' own ranks); lora_alpha a finite number > 0;
    use_rslora a boolean; and no PEFT feature vkv does not run. Anything else is refused by name."""
    if not isinstance(config, dict):
        raise ValueError(f"{what}: adapter_config.json must be a JSON object, not {type(config).__name__}")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    checks = [(isinstance(r, int) and not isinstance(r, bool) and r >= 1, f"r must be an integer >= 1, got {r!r}"),
              (_number(alpha) and alpha > 0, f"lora_alpha must be a finite number > 0, got {alpha!r}"),
              (isinstance(config.get("use_rslora", False), bool), "use_rslora must be true or false"),
              (isinstance(config.get("target_modules", []), (str, list)), "target_modules must be a string or a list")]
    for ok, why in checks:
        if not ok:
            raise ValueError(f"{what}: {why}")
    refusals = [(config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r} is not LORA"),
                (config.get("use_dora"), "DoRA (use_dora) is not supported"),
                (config.get("bias", "none") != "none", f"bias {config.get('bias')!r} is not supported (only 'none')"),
                (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} is not supported"),
                (config.get("alpha_pattern"), "alpha_pattern is not supported"),
                (config.get("fan_in_fan_out"), "fan_in_fan_out (GPT-2's Conv1D layout) does not fit a Llama model"),
                (config.get("lora_bias"), "lora_bias is not supported"),
                (config.get("layer_replication"), "layer_replication is not supported"),
                (config.get("trainable_token_indices"), "trainable_token_indices is not supported"),
                (config.get("target_parameters"), "target_parameters (LoRA on parameters, not modules) is not supported")]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"{what}: {why}")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex or "all-linear": the tensors' names decide
        unknown = [t for t in targets if not isinstance(t, str) or t not in TARGETS]
        if unknown:
            raise ValueError(f"{what}: target module {unknown[0]!r} is not one this model has "
                             f"(it has {', '.join(TARGETS)})")


def _read_weights(what: str, path: Path, most: int) -> tuple[dict[str, torch.Tensor], bytes]:
    """The checkpoint's tensors (on the CPU) and the bytes they came from (at most `most`)."""
    from engine.models.loader import parse_safetensors

    safetensors, pickled = path / "adapter_model.safetensors", path / "adapter_model.bin"
    for f in (safetensors, pickled):
        if f.is_file() and f.stat().st_size > most:
            raise ValueError(f"{what}: {f.name} is {f.stat().st_size} bytes, more than any adapter of rank "
                             f"max_lora_rank over this model holds ({most})")
    if safetensors.is_file():
        data = safetensors.read_bytes()
        try:
            return parse_safetensors(bytearray(data)), data
        except ValueError as exc:  # a truncated or foreign file
            raise ValueError(f"{what}: adapter_model.safetensors cannot be read ({exc})") from None
    if pickled.is_file():
        data = pickled.read_bytes()
        try:
            import io
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True), data
        except Exception as exc:
            raise ValueError(f"{what}: adapter_model.bin cannot be read ({exc})") from None
    raise ValueError(f"{what}: no adapter_model.safetensors (or adapter_model.bin) there")


class LoRARegistry:
    """The adapters an engine knows: those it serves by name (`served`: added with `serve`, until
    `drop`), and those in memory, at most `capacity`, least recently used dropped first (a served
    adapter dropped from memory is read again by its next request). Thread-safe."""

    def __init__(self, cfg: ModelConfig, max_rank: int, capacity: int, device: torch.device, dtype: torch.dtype):
        self.cfg, self.max_rank, self.capacity, self.device, self.dtype = cfg, max_rank, capacity, device, dtype
        self.adapters: OrderedDict[str, Adapter] = OrderedDict()
        self.served: dict[str, LoRARequest] = {}
        self.loads = 0  # adapters read from disk so far
        self._ids = 0  # the last lora_int_id handed out
        self._lock = threading.Lock()

    def next_id(self) -> int:
        with self._lock:
            self._ids += 1
            return self._ids

    def serve(self, request: LoRARequest) -> None:
        """Load and check an adapter (ValueError by name), then serve it by its name; a name
        already served is refused."""
        with self._lock:
            known = self.served.get(request.lora_name)
            if known is not None and known.lora_path != request.lora_path:
                raise ValueError(f"the name {request.lora_name!r} is taken: unload it first")
        self.get(request)
        with self._lock:
            self.served[request.lora_name] = request

    def get(self, request: LoRARequest) -> Adapter:
        """The adapter request names, loaded (and checked) if it is not in memory."""
        with self._lock:
            adapter = self.adapters.get(request.lora_name)
            if adapter is not None and adapter.path == str(Path(request.lora_path).expanduser()):
                self.adapters.move_to_end(request.lora_name)
                return adapter
        adapter = load_adapter(request, self.cfg, self.max_rank, self.device, self.dtype)  # outside the lock: disk
        with self._lock:
            self.loads += 1
            self.adapters[request.lora_name] = adapter
            self.adapters.move_to_end(request.lora_name)
            while len(self.adapters) > self.capacity:
                self.adapters.popitem(last=False)
            return adapter

    def drop(self, name: str) -> bool:
        """Forget an adapter, served or in memory (requests holding it finish with it); False if
        none by that name."""
        with self._lock:
            served = self.served.pop(name, None) is not None
            return (self.adapters.pop(name, None) is not None) or served

    def names(self) -> list[str]:
        """The adapters in memory."""
        with self._lock:
            return list(self.adapters)

    def requests(self) -> dict[str, LoRARequest]:
        """The adapters served, by name (a copy)."""
        with self._lock:
            return dict(self.served)


class LoRABatch:
    """A step's adapted rows: (adapter, first row, end row) per segment; rows of the base model
    are in none. With `native`, fp32 deltas run in the CPU kernels' `lora_segments` (one call
    per projection: a decode row's delta is a few hundred thousand multiply-adds, less than the
    overhead of two torch GEMM calls); otherwise, or in another dtype, two torch GEMMs per
    segment (`reference`)."""

    def __init__(self, segments: list[tuple[Adapter, int, int]], native: bool = False):
        self.segments, self.native = segments, native
        self.calls: dict[tuple[int, str], tuple[list, list, list[int]]] = {}  # per projection, built once a step

    @classmethod
    def of(cls, adapters: list[Adapter | None], starts: list[int], lengths: list[int],
           native: bool = False) -> LoRABatch | None:
        """The segments of sequences laid out in order (adjacent rows of one adapter merge);
        None when no row has an adapter."""
        segments: list[tuple[Adapter, int, int]] = []
        for adapter, start, n in zip(adapters, starts, lengths):
            if adapter is None:
                continue
            if segments and segments[-1][0] is adapter and segments[-1][2] == start:
                segments[-1] = (adapter, segments[-1][1], start + n)
            else:
                segments.append((adapter, start, start + n))
        return cls(segments, native) if segments else None

    def add(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[rows] += (x[rows] A^T) (B scaling)^T for each segment whose adapter adapts module."""
        call = self.calls.get((layer, module))
        if call is None:
            call = self.calls[layer, module] = ([], [], [])
            for adapter, start, end in self.segments:
                ab = adapter.weights[layer].get(module)
                if ab is not None:
                    call[0].append(ab[0])
                    call[1].append(ab[1])
                    call[2].extend((start, end))
        if not call[0]:
            return out
        if self.native and x.dtype == out.dtype == torch.float32:
            torch.ops.vkv.lora_segments(x, out, *call)
        else:
            reference(x, out, *call)
        return out


def reference(x: torch.Tensor, out: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
              bounds: list[int]) -> None:
    """What `lora_segments` computes, in torch: out[s:e] += (x[s:e] A^T) B per segment."""
    for i, (ai, bi) in enumerate(zip(a, b)):
        start, end = bounds[2 * i], bounds[2 * i + 1]
        out[start:end].addmm_(x[start:end] @ ai.t(), bi)
