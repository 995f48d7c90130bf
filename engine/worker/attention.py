"""Attention kernels, and the choice between them.

Every KV layout hands its caches over in one shape: per layer, K and V as [blocks, rows, heads,
D] (a virtual slot is one block as long as the slot; the block table's blocks are 16 rows),
and per sequence a row of a block table. A kernel reads sequence b's position p at
`cache[table[b, p // rows], p % rows]`, in place.

  native        vkv's CPU kernel (ext/cpu/attention.cpp, rope.cpp): rotary embedding and the K/V store in
                one call, then one attention call per layer for the whole batch
  flash         PyTorch's built-in FlashAttention-2 (CUDA, fp16/bf16, virtual layouts): one
                varlen call, slot offsets in `cum_seq_k`, lengths in `seqused_k`
  flash-attn    the flash-attn package (2.x, built by the user): `flash_attn_with_kvcache`,
                vAttention's own call: k_cache [slots, rows, H, D] with `cache_batch_idx` =
                slots and `cache_seqlens` = lengths; the block table through `block_table`
                (its blocks must be multiples of 256 rows). Decodes in one call, prefill
                chunks left-padded to the longest in a second.
  flash-attn-4  flash-attn-4 (CuTe DSL, Hopper and newer): `flash_attn_varlen_func` with the
                built-in flash's contract (`cu_seqlens_k` = slot offsets, `seqused_k`). It
                loads whole 128-row tiles, so the KV cache maps whole tiles and zeroes new
                pages (`tile_rows`).
  flex          FlexAttention (torch.nn.attention.flex_attention; torch.compile'd on CUDA): a
                maintained library's paged kernel, reading the block table's blocks (or a
                virtual slot's pieces) through a block mask: decodes in one call, prefill
                chunks per sequence on sdpa. The block table's blocks must be a power of two
                rows, 16 or more (its kernels prefer 128); not over interleaved slots (see
                Flex). On the CPU it runs only when named, over the block table: torch's
                unfused path there reads the whole cache
  sdpa          the reference: torch's rotary math, an indexed store, and one
                scaled_dot_product_attention call per sequence over its slot (a block table's
                blocks gathered first)
Each is an `AttentionBackend` (availability with its reason, the rows it loads past a
sequence's end, and `prepare`, which readies a step and returns what every layer calls),
chosen once by `pick_attention`; a GPU library is imported only by its backend, once.
"""
from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass

import torch

import ext
from engine.config import ATTENTION_BACKENDS
from engine.kv.batch import StepBatch
from engine.worker.attention_step import FP8, FlashStep, FlexStep, KVCacheStep, NativeStep, TorchStep, flash_varlen

LIBRARIES = {"flash-attn": ("flash_attn", "flash_attn_with_kvcache"),
             "flash-attn-4": ("flash_attn.cute", "flash_attn_varlen_func")}


def fa4_support(head_dim: int, capability: tuple[int, int]) -> tuple[int, str | None]:
    """flash-attn-4's KV tile for this head size on this GPU (the rows its TMA loads whole, so
    rows up to a tile boundary must be mapped and finite), or (0, why it is refused). The rule
    is the library's own (flash_attn/cute/interface.py at fa4-v4.0.0.beta27: `_validate_head_dims`
    and `_tile_size_fwd_sm90` for a causal, non-local call; SM100 runs 128-row tiles, and its
    head size 256 kernel refuses seqused_k, which vkv passes). The tile is not exported by the
    library, so it is reproduced here."""
    major = capability[0]
    if head_dim % 8:
        return 0, f"head_dim {head_dim} is not a multiple of 8"
    if major == 9:
        if not 8 <= head_dim <= 256:
            return 0, f"head_dim {head_dim} is outside 8..256 on Hopper"
        return (128 if head_dim <= 128 else 128 if head_dim <= 192 else 80), None
    if major in (10, 11):
        if not 8 <= head_dim <= 128:
            return 0, f"head_dim {head_dim} is outside 8..128 (the 256 kernel refuses seqused_k) on SM{major}x"
        return 128, None
    return 0, f"compute capability {major}.x is not Hopper or Blackwell"


def library(kernel: str):
    """The function a GPU library kernel calls, or None where the package is not installed."""
    module, name = LIBRARIES[kernel]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None




@dataclass(frozen=True)
class Target:
    """What a backend is asked to run on: the device, the compute dtype, the KV layout and the
    model's head size (and a sliding window, if the model has one), and what the KV cache
    stores (kv_dtype: None for the compute dtype; fp8 for kv_cache_dtype="fp8...")."""
    device: torch.device
    dtype: torch.dtype
    kv_layout: str
    head_dim: int
    block_size: int = 16
    sliding_window: int | None = None
    kv_dtype: torch.dtype | None = None
    named: bool = False  # the user named this backend (a backend may run only when asked for)

    @property
    def gpu_ready(self) -> bool:
        return self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16) \
            and self.head_dim % 8 == 0 and self.head_dim <= 256 and self.kv_dtype in (None, self.dtype)

    @property
    def why_not_gpu(self) -> str:
        if self.kv_dtype not in (None, self.dtype):
            return (f"reads KV in the compute dtype only, not {str(self.kv_dtype).removeprefix('torch.')} "
                    "(kv_cache_dtype): that cache runs on sdpa")
        return ""


class AttentionBackend:
    """One attention kernel: whether it can run on a target (and why not), the rows it loads
    past a sequence's end, and `prepare`, which readies one step and returns what every layer
    calls: `step(layer, q, k, v)`."""
    name = ""
    target: Target | None = None  # what pick_attention chose it for

    def unavailable(self, t: Target) -> str | None:
        """None where this backend runs on t, else why not."""
        raise NotImplementedError

    def tile_rows(self, t: Target) -> int:
        """Rows the kernel may load past a sequence's length (the KV cache maps and zeroes them)."""
        return 1

    def prepare(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], batch: StepBatch,
                cos_sin: torch.Tensor, paged: bool = False, window: int | None = None) -> TorchStep:
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name


class Native(AttentionBackend):
    name = "native"

    def unavailable(self, t: Target) -> str | None:
        narrower = {torch.float32: (torch.bfloat16, *FP8), torch.bfloat16: FP8}.get(t.dtype, ())
        if t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) and t.head_dim % 2 == 0 \
                and t.kv_dtype in (None, t.dtype, *narrower) and ext.cpu_kernels() is not None:
            return None
        return "needs the CPU, fp32 or bf16 (KV the same, bf16 or fp8), an even head_dim and the built kernels " \
            f"({ext.cpu_kernels_error()})"

    def prepare(self, k_caches, v_caches, batch, cos_sin, paged=False, window=None) -> NativeStep:
        if ext.cpu_kernels() is None:
            raise RuntimeError(f"the native attention kernel is unavailable: {ext.cpu_kernels_error()}")
        return NativeStep(k_caches, v_caches, batch, cos_sin, window)


class Sdpa(AttentionBackend):
    name = "sdpa"

    def unavailable(self, t: Target) -> str | None:
        return None

    def prepare(self, k_caches, v_caches, batch, cos_sin, paged=False, window=None) -> TorchStep:
        return TorchStep(k_caches, v_caches, batch, cos_sin, window)


class Flash(AttentionBackend):
    name = "flash"

    def unavailable(self, t: Target) -> str | None:
        if t.gpu_ready and t.kv_layout != "paged":
            return None
        return t.why_not_gpu or "needs a CUDA device, fp16/bf16, a virtual kv_layout and head_dim a multiple of 8 up to 256"

    def prepare(self, k_caches, v_caches, batch, cos_sin, paged=False, window=None) -> FlashStep:
        return FlashStep(k_caches, v_caches, batch, cos_sin, window, flash_varlen)


class FlashAttn4(AttentionBackend):
    name = "flash-attn-4"

    def __init__(self):
        self.call = library(self.name)  # looked up once, when the backend is chosen

    def unavailable(self, t: Target) -> str | None:
        why = fa4_support(t.head_dim, torch.cuda.get_device_capability(t.device))[1] if t.device.type == "cuda" \
            else "no GPU"
        if t.gpu_ready and t.kv_layout != "paged" and why is None and self.call:
            return None
        return t.why_not_gpu or "needs flash-attn-4 installed, fp16/bf16, a virtual layout and a GPU it supports" + \
            (f" ({why})" if why else "")

    def tile_rows(self, t: Target) -> int:
        return fa4_support(t.head_dim, torch.cuda.get_device_capability(t.device))[0]

    def prepare(self, k_caches, v_caches, batch, cos_sin, paged=False, window=None) -> FlashStep:
        call = self.call

        def varlen(q, k, v, cu_q, k_starts, max_q, max_k, seqused_k):
            out = call(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=k_starts, max_seqlen_q=max_q, max_seqlen_k=max_k,
                       seqused_k=seqused_k, causal=True, num_splits=1)
            return out[0] if isinstance(out, tuple) else out
        return FlashStep(k_caches, v_caches, batch, cos_sin, window, varlen)


class FlashAttn(AttentionBackend):
    name = "flash-attn"

    def __init__(self):
        self.call = library(self.name)

    def unavailable(self, t: Target) -> str | None:
        if t.gpu_ready and (t.kv_layout != "paged" or t.block_size % 256 == 0) and self.call:
            return None
        return t.why_not_gpu or \
            "needs the flash-attn package, a CUDA GPU, fp16/bf16, and a virtual layout or blocks of 256 rows"

    def prepare(self, k_caches, v_caches, batch, cos_sin, paged=False, window=None) -> KVCacheStep:
        return KVCacheStep(k_caches, v_caches, batch, cos_sin, window, self.call, paged)


class Flex(AttentionBackend):
    """FlexAttention: see FlexStep. What its CUDA kernels ask (torch 2.11's inductor lowering):
    KV blocks of a power of two rows, 16 or more, with the kernel's key tile no wider than a
    block (BLOCK_N, passed); key offsets in int32 on its general kernel (the one a batch of
    changing size compiles to), so a layer's key range must stay under 2^31 elements (checked
    each step; interleaved slots, whose rows stride over every layer, are refused up front); and
    whole blocks loaded, so a virtual cache maps and zeroes 128-row tiles. Past dynamo's
    recompile limit a compiled function would run torch's unfused path, which reads the whole
    key range (a virtual cache's unmapped rows too): the limit is raised and reaching it fails."""
    name = "flex"
    compiled = None  # torch.compile(flex_attention), made once a process (its kernels are cached by shape)
    PIECE = 128  # rows of a virtual slot's pieces (its tiles)

    def __init__(self, static_batch: bool = False):
        """static_batch: each batch size compiled apart, so flex's decode kernel (which splits the
        keys) runs; the engine keeps one kernel for every size (a benchmark of the kernel asks it)."""
        self.static_batch = static_batch

    def unavailable(self, t: Target) -> str | None:
        if t.kv_layout == "paged" and (t.block_size < 16 or t.block_size & (t.block_size - 1)):
            return f"reads blocks of a power of two rows, 16 or more, not {t.block_size} (--block-size)"
        if t.kv_dtype not in (None, t.dtype):
            return "reads KV in the compute dtype only: an fp8 cache runs on sdpa"
        if t.device.type == "cuda" and t.kv_layout == "interleaved":
            return "indexes a layer's keys in int32, and interleaved slots stride over every layer: use flash"
        if t.device.type == "cuda" and t.gpu_ready:
            return None
        if t.device.type == "cpu" and t.named and t.kv_layout == "paged":
            return None
        return "runs on a CUDA GPU in fp16/bf16 with head_dim a multiple of 8 up to 256 (on the CPU: when named, " \
            "over the block table: torch's unfused path there reads every row of the cache, mapped or not)"

    def tile_rows(self, t: Target) -> int:
        return self.PIECE if t.device.type == "cuda" else 1

    def prepare(self, k_caches, v_caches, batch, cos_sin, paged=False, window=None) -> FlexStep:
        cache = k_caches[0]
        rows = cache.shape[1]
        kv_block = rows if paged else next((b for b in (self.PIECE, 64, 32, 16) if rows % b == 0), 0)
        if not kv_block:
            raise ValueError(f"FlexAttention reads a slot in pieces of 16 to 128 rows; these slots have {rows}")
        options = None
        if cache.device.type == "cuda":
            span = (cache.shape[0] * rows - 1) * cache.stride(1) + cache.shape[2] * cache.shape[3]
            if span >= 2 ** 31:
                raise ValueError(f"FlexAttention's kernels index a layer's keys in int32: this cache spans {span} "
                                 "elements of one (the interleaved layout strides over every layer): use flash")
            options = {"BLOCK_N": min(kv_block, 64)}
        return FlexStep(k_caches, v_caches, batch, cos_sin, window, self.kernel(cache.device), kv_block, paged,
                        options, self.static_batch)

    @classmethod
    def kernel(cls, device: torch.device):
        """flex_attention as it runs on `device`: compiled on CUDA (the unfused path reads the whole
        cache), as it is on the CPU (compiling there takes ~20 s a shape; the CPU's kernel is native)."""
        from torch.nn.attention.flex_attention import flex_attention
        if device.type != "cuda":  # (unfused by choice: torch's warning about it said once, here)
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
            return flex_attention
        if cls.compiled is None:
            import torch._dynamo.config as dynamo

            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)  # layouts x head shapes x batch kinds
            dynamo.fail_on_recompile_limit_hit = True  # never the unfused path over a virtual cache
            cls.compiled = torch.compile(flex_attention)
        return cls.compiled


BACKENDS: dict[str, type[AttentionBackend]] = {b.name: b for b in (FlashAttn4, FlashAttn, Flash, Native, Flex, Sdpa)}


def pick_attention(name: str | None, device: torch.device, dtype: torch.dtype, kv_layout: str,
                   head_dim: int, block_size: int = 16, sliding_window: int | None = None,
                   kv_dtype: torch.dtype | None = None) -> AttentionBackend:
    """The user's choice, checked; else the best backend that runs here, in BACKENDS' order (a
    sliding window runs on sdpa alone: the others are not given the window)."""
    assert tuple(BACKENDS) == ATTENTION_BACKENDS
    target = Target(device, dtype, kv_layout, head_dim, block_size, sliding_window, kv_dtype, named=bool(name))
    for candidate in ([name] if name else BACKENDS):
        if candidate not in BACKENDS:
            raise ValueError(f"unknown attention backend {candidate!r}: choose one of {ATTENTION_BACKENDS}")
        backend = BACKENDS[candidate]()
        why = backend.unavailable(target)
        if sliding_window and candidate != "sdpa":
            why = why or "is not given sliding windows yet: use sdpa"
        if why is None:
            backend.target = target
            return backend
        if name:
            raise ValueError(f"attention {name!r} {why}")
    raise AssertionError("sdpa runs everywhere")


def tile_rows(backend: AttentionBackend | str, head_dim: int, device: torch.device) -> int:
    """Rows a kernel may load past a sequence's length (the KV cache maps and zeroes them)."""
    backend = BACKENDS[backend]() if isinstance(backend, str) else backend
    return backend.tile_rows(Target(device, torch.float16, "per_layer", head_dim))


def StepAttention(kernel: str | AttentionBackend, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  batch: StepBatch, cos_sin: torch.Tensor, paged: bool = False, window: int | None = None):
    """One step's attention over the given caches with the named backend (for tests and
    benchmarks that name one; the engine prepares its chosen backend once a step)."""
    backend = BACKENDS[kernel]() if isinstance(kernel, str) else kernel
    return backend.prepare(k_caches, v_caches, batch, cos_sin, paged, window)
