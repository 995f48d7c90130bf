"""Engine settings, checked once and resolved against the device and the model. The command
line's engine flags are declared here too (`add_cli_args` / `from_cli_args`), so every front
end (generate, serve, benchmarks) parses them the same way."""
from __future__ import annotations

import argparse
import json
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

import ext

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
KV_LAYOUTS = ("interleaved", "per_layer", "paged")
# kv_cache_dtype, vLLM's names: "auto" stores KV in the model's dtype; "fp8" is fp8_e4m3. The
# fp8 formats are unscaled (vLLM's default scale of 1.0): e4m3 keeps 3 mantissa bits up to 448,
# e5m2 2 bits up to 57344. Half of bf16's bytes, a quarter of fp32's.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
QUANTIZATIONS = ("gguf", "dequantize")  # a GGUF's weights as stored, or the weights in dtype (ModelArgs)
ATTENTION_BACKENDS = ("flash-attn-4", "flash-attn", "flash", "native", "flex", "sdpa")  # by preference
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREEMPTION_MODES = ("recompute", "swap")


def check_scheduling(policy: str, preemption_mode: str) -> None:
    """The scheduling policy and preemption mode, checked once for the config and the scheduler."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling_policy {policy!r}: choose one of {SCHEDULING_POLICIES}")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"unknown preemption_mode {preemption_mode!r}: choose one of {PREEMPTION_MODES}")
DEFAULT_HOST_PAGE = 64 << 10  # small pages: the host backend's advantage over 2 MiB GPU pages
_EVENT_FIELD_TYPES = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": str,
                      "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str, "token_ids": bool,
                      "allow_remote": bool, "curve_secret_key": str, "curve_client_keys": str}
_EVENT_NULLABLE = {"publisher", "replay_endpoint", "token_ids", "curve_secret_key", "curve_client_keys"}
_EVENT_TYPE_NAMES = {bool: "true or false", str: "a string", int: "an integer"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def endpoint_is_local(url: str, name: str = "endpoint") -> bool:
    """Whether a ZMQ endpoint stays on this machine (loopback, ipc://, inproc://); ValueError,
    naming the field, for one that cannot work: another scheme, a port out of range, a host
    that does not resolve."""
    import ipaddress
    import socket
    scheme, _, rest = url.partition("://")
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise ValueError(f"kv_events_config: {name} {url!r} names no path")
        return True
    if scheme != "tcp" or not rest:
        raise ValueError(f"kv_events_config: {name} {url!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    host, _, port = rest.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"kv_events_config: {name} {url!r}: the port must be a number in [1, 65535]")
    if host in ("*", "0.0.0.0", "::", ""):
        return False
    if host in LOOPBACK:
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, int(port))}
    except OSError:
        raise ValueError(f"kv_events_config: {name} {url!r}: host {host!r} does not resolve") from None
    return all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


@dataclasses.dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig: its fields, names and defaults (the endpoint's aside: loopback),
    and four of vkv's own, for tenants and networks (engine/kv/publisher.py says what each does):
      token_ids          announce each stored page's tokens (vLLM's, and what llm-d and Dynamo
                         hash); None: yes, except under `vkv serve --isolate-clients`, where a
                         listener would read every tenant's prompts: then only the pages' names
      allow_remote       an endpoint other than loopback, ipc:// or inproc:// (anyone who can
                         reach the port reads the stream): refused unless set
      curve_secret_key   a file with this publisher's ZMQ CURVE key pair (zmq.auth's format):
                         only subscribers whose public key is in curve_client_keys connect
      curve_client_keys  the directory of those subscribers' public key files"""
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: "zmq" when enabled
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the sending thread
    topic: str = ""
    token_ids: bool | None = None
    allow_remote: bool = False
    curve_secret_key: str | None = None
    curve_client_keys: str | None = None

    @classmethod
    def of(cls, value: dict | KVEventsConfig | None) -> KVEventsConfig | None:
        """The config from a dict (CLI JSON, LLM kwargs); unknown fields, values of the wrong
        type and endpoints that cannot work refused by name."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(value).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(value) - set(known)):
            raise ValueError(f"kv_events_config: unknown field(s) {unknown}; known: {sorted(known)}")
        for name, given in value.items():  # JSON's types, no coercion: "yes" is not true, true is not 1
            kind = _EVENT_FIELD_TYPES[name]
            if not (given is None and name in _EVENT_NULLABLE) and not (
                    isinstance(given, kind) and not (kind is int and isinstance(given, bool))):
                raise ValueError(f"kv_events_config: {name} must be {_EVENT_TYPE_NAMES[kind]}, got {given!r}")
        config = cls(**value)
        if config.publisher is None:
            config.publisher = "zmq" if config.enable_kv_cache_events else "null"
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: unknown publisher {config.publisher!r}: choose 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(config, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be >= 1")
        if config.publishes:
            config.check_endpoints()
        return config

    def check_endpoints(self) -> None:
        """Each endpoint is tcp://HOST:PORT, ipc://PATH or inproc://NAME, its host resolves and its
        port is a port; one other than loopback needs allow_remote; CURVE's two fields go together."""
        for name in ("endpoint", "replay_endpoint"):
            if (url := getattr(self, name)) is not None and not endpoint_is_local(url, name) and not self.allow_remote:
                raise ValueError(f"kv_events_config: {name} {url!r} is reachable from other machines: anyone who "
                                 f"can connect reads every announced page; set allow_remote (with curve keys to "
                                 f"admit only your routers) or use a loopback address")
        if (self.curve_secret_key is None) != (self.curve_client_keys is None):
            raise ValueError("kv_events_config: curve_secret_key and curve_client_keys go together")
        if self.curve_secret_key is not None:
            import os
            if not os.path.isfile(self.curve_secret_key):
                raise ValueError(f"kv_events_config: curve_secret_key {self.curve_secret_key!r} is not a file")
            if not os.path.isdir(self.curve_client_keys):
                raise ValueError(f"kv_events_config: curve_client_keys {self.curve_client_keys!r} is not a directory")

    def for_tenants(self, isolated: bool) -> KVEventsConfig:
        """The config a server with (or without) --isolate-clients runs: there, pages are
        announced without their tokens unless subscribers must present a CURVE key."""
        if not isolated:
            return self
        if self.token_ids and self.curve_secret_key is None:
            raise ValueError("kv_events_config: token_ids under --isolate-clients would hand every tenant's prompts "
                             "to any subscriber: give curve_secret_key and curve_client_keys, or leave token_ids out")
        return dataclasses.replace(self, token_ids=bool(self.token_ids and self.curve_secret_key))

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"



def _at_least(config, names: tuple[str, ...], low: int) -> None:
    for name in names:
        if getattr(config, name) < low:
            raise ValueError(f"{name} must be >= {low}, got {getattr(config, name)}")


# -- one config per concern (vLLM's ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
# LoRAConfig): each holds its fields and checks them when it is made, alone or as part of an
# EngineConfig; what depends on two concerns is EngineConfig's `check_pairs`. ---------------
@dataclass
class ModelArgs:
    """What runs: the checkpoint, the device, the dtypes, the attention kernel."""
    model: str | None = None
    device: str | None = None  # cpu | cuda[:N]; default: cuda when present
    dtype: str | torch.dtype | None = None  # default: bf16 on cuda, fp32 on cpu
    attention_backend: str | None = None  # one of ATTENTION_BACKENDS; default: best present
    enable_sleep_mode: bool = False  # weights in pages that sleep(level=2) gives back (engine/models/weight_pages.py)
    enforce_eager: bool = False  # vLLM's: no CUDA graphs for decode steps (engine/worker/cuda_graphs.py)
    seed: int = 0  # a random:<preset> model's weights
    # "gguf": a GGUF model's weights kept in their blocks (gguf_weights.TYPES); "dequantize": the
    # weights in dtype (a GGUF's widened once); default (None): "gguf" for a GGUF where the blocks
    # serve the other settings, else "dequantize" (`gguf_blocks`)
    quantization: str | None = None

    def __post_init__(self):
        self.check_model()

    @property
    def gguf_model(self) -> bool:
        """Whether the model is a GGUF file (the bundled model is one)."""
        return self.model is None or str(self.model).endswith(".gguf")

    def check_model(self) -> None:
        self.device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but PyTorch sees no CUDA GPU")
        if self.dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        elif isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {sorted(DTYPES)}")
            self.dtype = DTYPES[self.dtype]
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}: "
                             f"choose one of {ATTENTION_BACKENDS}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown quantization {self.quantization!r}: 'gguf' (a .gguf model's blocks as "
                             "stored) or 'dequantize' (its weights widened to dtype)")
        if self.quantization == "gguf":
            if not self.gguf_model:
                raise ValueError(f"quantization='gguf' serves a .gguf file (or the bundled model); {self.model!r} "
                                 "is not one")
            if self.device.type != "cpu":
                raise ValueError("quantization='gguf' runs on the CPU so far")
            if self.enable_sleep_mode:
                raise ValueError("quantization='gguf' with enable_sleep_mode is not wired: the blocks are not in pages")


@dataclass
class CacheConfig:
    """The KV cache: its layout and bytes, its pages, prefix caching, the tiers below it, the
    pool it may draw from, and what it announces."""
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES: "auto" is the model's dtype
    kv_layout: str | None = None  # default: per_layer on the CPU, interleaved on a GPU (EngineConfig.check_pairs)
    kv_cache_memory: int | None = None  # bytes of physical KV pages; default: kv_budget_bytes
    gpu_memory_utilization: float = 0.9  # share of free GPU memory for KV when no byte budget
    page_size: int | None = None  # bytes; default: 2 MiB on cuda, 64 KiB on the host
    block_size: int = 16  # tokens per block, paged layout
    enable_prefix_caching: bool = True
    swap_space: float = 4  # GiB of swap tier (preemption_mode="swap"): a sparse file, pinned memory on CUDA
    swap_path: str | None = None  # the host tier's file; default: an anonymous temporary file
    # KV tiers for evicted prefix-cache entries (engine/kv/tiers.py), vLLM's names. Off by default:
    # on the CPU the host tier takes the same RAM the pool could have had, so it pays only
    # where the pool is bounded for another reason (on a GPU: pinned host memory, many times
    # the pool); a disk tier needs a directory the user chooses.
    kv_offloading_size: float = 0  # GiB of host tier (0: none)
    kv_offloading_path: str | None = None  # directory of the persistent disk tier (None: none)
    kv_offloading_path_size: float = 16  # GiB the disk tier may hold
    # A physical KV pool shared by several engine processes (vmm/owner.py): the owner's socket. The
    # engine's pages come from it and complete pages are published there, so a prefix one process
    # computed is read in place by the others (host backend, virtual layouts).
    kv_pool: str | None = None
    # KV events in vLLM's format (engine/kv/publisher.py): vLLM's KVEventsConfig as a dict, e.g.
    # {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}
    kv_events_config: dict | KVEventsConfig | None = None
    map_ahead_tokens: int = 0  # > 0: a worker thread maps each sequence's next pages during the forward pass

    def __post_init__(self):
        self.check_cache()

    def check_cache(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}: choose one of {tuple(KV_CACHE_DTYPES)}")
        if self.kv_layout not in (None, *KV_LAYOUTS):
            raise ValueError(f"unknown kv_layout {self.kv_layout!r}: choose one of {KV_LAYOUTS}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        _at_least(self, ("block_size",), 1)
        _at_least(self, ("map_ahead_tokens",), 0)
        if self.swap_space <= 0:
            raise ValueError(f"swap_space must be > 0 GiB, got {self.swap_space}")
        if self.kv_offloading_size < 0 or self.kv_offloading_path_size <= 0:
            raise ValueError("kv_offloading_size must be >= 0 GiB and kv_offloading_path_size > 0 GiB, got "
                             f"{self.kv_offloading_size} and {self.kv_offloading_path_size}")
        if self.kv_events_config is not None:
            self.kv_events_config = KVEventsConfig.of(self.kv_events_config)

    @property
    def offloading(self) -> bool:
        """Is there a KV tier below the pool?"""
        return bool(self.kv_offloading_size or self.kv_offloading_path)


@dataclass
class SchedulerConfig:
    """How steps are made: their sizes, the admission and preemption rules, several decode
    steps in one call, speculative drafts."""
    max_num_seqs: int = 32
    max_model_len: int | None = None  # default: min(model's, 2048)
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"  # "priority": a request's priority value, lower first; "lpm": longest cached prefix first
    preemption_mode: str = "recompute"  # or "swap": private pages to the swap tier (virtual layouts)
    # vLLM v0's multi-step decode: up to this many greedy decode steps run in one native call, with no
    # scheduling or sampling in Python between them (engine/core/multi_step.py says when; 1: off)
    num_scheduler_steps: int = 1
    speculative_config: dict | None = None  # vLLM's: {"method": "ngram", "num_speculative_tokens": k, ...}

    def __post_init__(self):
        self.check_scheduler()

    def check_scheduler(self) -> None:
        check_scheduling(self.scheduling_policy, self.preemption_mode)
        _at_least(self, ("max_num_seqs", "max_num_batched_tokens"), 1)
        if not isinstance(self.num_scheduler_steps, int) or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1, got {self.num_scheduler_steps!r}")
        if self.num_scheduler_steps > 1 and self.speculative_config:
            raise ValueError("num_scheduler_steps > 1 with speculative_config: a step either verifies drafts "
                             "or runs several greedy steps, not both (as in vLLM)")


@dataclass
class ParallelConfig:
    """Ranks: tensor parallelism across processes, and this engine's place among replicas."""
    tensor_parallel_size: int = 1  # ranks sharing every layer's heads (CPU, torch.distributed gloo)
    distributed_init: str | None = None  # rank 0's rendezvous, e.g. tcp://10.0.0.1:29500; default: a free local port
    tensor_parallel_workers: str = "spawn"  # or "external": ranks 1..N-1 are started with `vkv tp-worker`
    data_parallel_rank: int = 0  # this engine's rank among replicas: its events' rank and port offset

    def __post_init__(self):
        self.check_parallel()

    def check_parallel(self) -> None:
        _at_least(self, ("tensor_parallel_size",), 1)
        _at_least(self, ("data_parallel_rank",), 0)
        if self.tensor_parallel_workers not in ("spawn", "external"):
            raise ValueError(f"tensor_parallel_workers must be 'spawn' or 'external', got {self.tensor_parallel_workers!r}")
        if self.tensor_parallel_workers == "external" and not self.distributed_init:
            raise ValueError("tensor_parallel_workers='external' needs distributed_init (where the workers meet rank 0)")


@dataclass
class LoRAConfig:
    """LoRA adapters (engine/worker/lora.py), vLLM's names: requests may name an adapter; a step
    runs rows of at most max_loras distinct adapters; at most max_cpu_loras stay loaded."""
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras

    def __post_init__(self):
        self.check_lora()

    def check_lora(self) -> None:
        _at_least(self, ("max_loras", "max_lora_rank"), 1)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")


@dataclass
class EngineConfig(LoRAConfig, ParallelConfig, SchedulerConfig, CacheConfig, ModelArgs):
    """Every engine setting, by the names LLM(...) and the command line take (vLLM's EngineArgs):
    the fields of the five concerns above (bases listed last-first, so `model` comes first), each
    concern checking its own, then the pairs across concerns (`check_pairs`)."""

    def __post_init__(self):
        self.check_model()
        self.check_cache()
        self.check_scheduler()
        self.check_parallel()
        self.check_lora()
        self.check_pairs()

    def check_pairs(self) -> None:
        """Settings of two concerns that depend on each other:
          kv_layout's default            <- device (model)
          preemption_mode "swap"         x kv_layout "paged"
          enable_sleep_mode (model)      x tensor_parallel_size
          KV tiers, kv_pool (cache)      x enable_prefix_caching, kv_layout, tensor_parallel_size
          KV events (cache)              x enable_prefix_caching
          tensor_parallel_size           x device, enable_lora
          quantization (model)           x tensor_parallel_size, enable_lora (its default: gguf_blocks)"""
        if self.kv_layout is None:
            # On the CPU per_layer is the faster (design_choices.json, "cpu_default_layout"): the
            # host maps 4 KiB page-table entries, and an interleaved token
            # row (every layer's K and V) puts each key of a layer on its own page: a TLB miss per
            # key. On a GPU, 2 MiB pages make interleaved's one-map-per-page the better trade.
            self.kv_layout = "interleaved" if self.device.type == "cuda" else "per_layer"
        if self.preemption_mode == "swap" and self.kv_layout == "paged":
            raise ValueError("preemption_mode='swap' needs a virtual kv_layout (interleaved or per_layer): "
                             "it brings pages back at the same virtual addresses")
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise ValueError("enable_sleep_mode with tensor_parallel_size > 1: the other ranks' weights are other "
                             "processes' memory, which sleep level 2 cannot give back yet")
        if self.offloading and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size / kv_offloading_path keep evicted prefix-cache entries: "
                             "they need prefix caching on")
        if self.offloading and self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_size / kv_offloading_path with tensor_parallel_size > 1 is not "
                             "wired: each rank would need its own tier")
        if self.kv_pool is not None and (self.kv_layout == "paged" or self.tensor_parallel_size > 1
                                         or self.offloading):
            raise ValueError("kv_pool (a pool shared across processes) is wired for one rank with a virtual "
                             "kv_layout and no KV tiers so far")
        if self.kv_events_config is not None and self.kv_events_config.publishes and not self.enable_prefix_caching:
            raise ValueError("kv_events_config announces prefix-cache pages: it needs prefix caching on")
        if self.tensor_parallel_size > 1 and self.device.type != "cpu":
            raise ValueError("tensor parallelism runs on the CPU (gloo) so far; the GPU path (NCCL) is not wired")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("enable_lora with tensor_parallel_size > 1 is not wired: the adapters' deltas "
                             "would need sharding like the weights")
        if self.quantization == "gguf" and (self.tensor_parallel_size > 1 or self.enable_lora):
            raise ValueError("quantization='gguf' with tensor parallelism or LoRA is not wired yet")

    @property
    def gguf_blocks(self) -> bool:
        """Whether the weights stay in a GGUF's blocks: quantization "gguf", or by default a GGUF
        model on the CPU with vkv's kernels built, one rank, no LoRA, no sleep mode, dtype fp32 or
        bf16 (what the blocks serve so far: gguf_weights.py, Limitations), whose matrices
        are mostly of types the blocks serve (`mostly_in_blocks`). Read, never stored: a copy of
        this config for another model (MultiLLM) decides again."""
        if self.quantization is not None:
            return self.quantization == "gguf"
        if not (self.gguf_model and self.device.type == "cpu" and self.tensor_parallel_size == 1
                and not self.enable_lora and not self.enable_sleep_mode
                and self.dtype in (torch.float32, torch.bfloat16) and ext.cpu_kernels() is not None):
            return False
        from engine.models.gguf_weights import mostly_in_blocks
        from engine.models.loader import bundled_gguf
        return mostly_in_blocks(bundled_gguf() if self.model is None else Path(self.model).expanduser())

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: `dtype`, or the fp8 format kv_cache_dtype names."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (activations, GEMMs); weights are rounded to `dtype`
        first and the KV cache is stored in `kv_dtype`. See `arithmetic`."""
        return self.arithmetic()[0]

    def arithmetic(self) -> tuple[torch.dtype, str]:
        """(compute dtype, why). bf16 on a CPU without native bf16 arithmetic (AVX2, most
        AVX-512 before Cooper Lake) keeps bf16 weights' values and a bf16 KV cache but computes
        in fp32: oneDNN refuses bf16 weights there, and where it emulates them it is several
        times slower than fp32. Weights in GGUF blocks compute in fp32 on every CPU: their kernels
        take fp32 x (rounding it to int8 themselves) and so does the one-call decode step over
        them, so a bf16 GGUF model's tokens do not depend on the CPU having native bf16."""
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            if self.gguf_blocks:
                return torch.float32, "bf16 KV cache and norms, fp32 arithmetic: the weights are in GGUF blocks"
            native, why = ext.bf16_gemm()
            if not native:
                return torch.float32, f"bf16 weights and KV cache, fp32 arithmetic: {why}"
            return torch.bfloat16, why
        return self.dtype, f"{str(self.dtype).removeprefix('torch.')} throughout"

    def resolve_max_model_len(self, model_max: int) -> int:
        if self.max_model_len is None:
            self.max_model_len = min(model_max, 2048)
        if not 1 <= self.max_model_len <= model_max:
            raise ValueError(f"max_model_len must be in [1, {model_max}], got {self.max_model_len}")
        return self.max_model_len

    def kv_budget_bytes(self, activation_peak: int = 0) -> int:
        """The KV pages' bytes: kv_cache_memory if given; on a GPU, gpu_memory_utilization of
        the memory free after the weights, less the activation peak of a worst-case step
        (measured by the caller's profile run, as vLLM does); 1 GiB on the CPU."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator cannot see VMM pages
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.gpu_memory_utilization) - activation_peak
            if budget <= 0:
                raise ValueError(f"no GPU memory left for the KV cache: {free} bytes free after the weights, "
                                 f"{activation_peak} needed by a step of {self.max_num_batched_tokens} tokens")
            return budget
        return 1 << 30

    # -- the command line -----------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("engine")
        g.add_argument("--model", action="append", default=None, help="checkpoint dir, .gguf file or "
                       "random:<preset> (default: the bundled SmolLM2-135M-Instruct); `vkv serve` takes "
                       "several as NAME=SOURCE, which share one KV pool")
        g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
        g.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bf16 on cuda, fp32 on cpu")
        g.add_argument("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, choices=tuple(KV_CACHE_DTYPES),
                       help="what the KV cache stores: auto (the model's dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, "
                       "half of bf16's bytes per token")
        g.add_argument("--kv-layout", default=None, choices=KV_LAYOUTS,
                       help="default: per_layer on the CPU, interleaved on a GPU")
        g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pages (default: 1 GiB "
                       "on the CPU, gpu-memory-utilization of free memory on a GPU)")
        g.add_argument("--page-size", type=int, default=None, help="bytes per physical page")
        g.add_argument("--block-size", type=int, default=EngineConfig.block_size, help="tokens per block (paged)")
        g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
        g.add_argument("--attention-backend", default=None, choices=ATTENTION_BACKENDS)
        g.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: no CUDA graphs for decode steps (GPU)")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="a .gguf model's weights: gguf keeps its Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K blocks (the "
                            "default on the CPU for a file mostly of those, with one rank, no LoRA, no sleep mode); "
                            "dequantize widens them to --dtype")
        g.add_argument("--enable-sleep-mode", action="store_true", help="keep the weights in pages that "
                       "sleep level 2 gives back (RL loops; costs start time: off by default)")
        g.add_argument("--scheduling-policy", default=EngineConfig.scheduling_policy, choices=SCHEDULING_POLICIES,
                       help="priority: requests' priority values decide admission and preemption; "
                       "lpm: the longest cached prefix (in any tier) is admitted first")
        g.add_argument("--preemption-mode", default=EngineConfig.preemption_mode, choices=PREEMPTION_MODES,
                       help="swap: a preempted sequence's KV waits in the swap tier instead of being recomputed")
        g.add_argument("--swap-space", type=float, default=EngineConfig.swap_space, help="GiB of swap tier")
        g.add_argument("--swap-path", default=None, help="file for the host swap tier (default: a temporary file)")
        g.add_argument("--kv-offloading-size", type=float, default=EngineConfig.kv_offloading_size,
                       help="GiB of host memory where evicted prefix-cache pages wait to be restored (0: off)")
        g.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                       help="directory of a persistent KV tier: cached prefixes survive a restart")
        g.add_argument("--kv-offloading-path-size", type=float, default=EngineConfig.kv_offloading_path_size,
                       help="GiB the directory may hold (oldest entries go first)")
        g.add_argument("--kv-pool", default=None, metavar="SOCKET", help="draw KV pages from the shared pool "
                       "of `vkv pool-owner` at SOCKET: engine processes read each other's cached prefixes in place")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=EngineConfig.tensor_parallel_size,
                       help="processes sharing every layer's heads, each with its own KV page pool")
        g.add_argument("--distributed-init", default=None, help="rendezvous of rank 0, e.g. tcp://HOST:PORT")
        g.add_argument("--tensor-parallel-workers", default=EngineConfig.tensor_parallel_workers,
                       choices=("spawn", "external"), help="external: start ranks 1..N-1 with `vkv tp-worker`")
        g.add_argument("--map-ahead-tokens", type=int, default=EngineConfig.map_ahead_tokens,
                       help="tokens per sequence whose pages a worker thread maps during each forward pass (0: off)")
        g.add_argument("--num-scheduler-steps", type=int, default=EngineConfig.num_scheduler_steps,
                       help="greedy decode steps run in one native call when every running sequence is a plain "
                       "greedy decode (vLLM's multi-step; tokens then arrive in bursts of this many; 1: off)")
        g.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                       help='e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
        g.add_argument("--kv-events-config", type=json.loads, default=None, metavar="JSON",
                       help="publish KV events in vLLM's format (vLLM's KVEventsConfig), e.g. "
                       '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", '
                       '"replay_endpoint": "tcp://127.0.0.1:5558", "topic": "kv"} (vkv\'s own fields: token_ids, '
                       'allow_remote, curve_secret_key, curve_client_keys)')
        g.add_argument("--data-parallel-rank", type=int, default=0,
                       help="this engine's rank among replicas: its KV events carry it and its ports are offset by it")
        g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the model "
                       "(requests name one; `vkv serve --lora-modules NAME=PATH`)")
        g.add_argument("--max-loras", type=int, default=EngineConfig.max_loras,
                       help="distinct adapters running in one step")
        g.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank,
                       help="the largest adapter rank accepted")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept loaded (least recently used dropped first; default: --max-loras)")
        g.add_argument("--model-seed", type=int, default=EngineConfig.seed, help="weights of random:<preset> models")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = ("model", "device", "dtype", "kv_cache_dtype", "kv_layout", "kv_cache_memory", "page_size", "block_size",
                 "max_num_seqs", "max_model_len", "max_num_batched_tokens", "attention_backend", "enforce_eager",
                 "enable_prefix_caching", "enable_sleep_mode", "quantization", "scheduling_policy", "preemption_mode", "swap_space", "swap_path",
                 "kv_offloading_size", "kv_offloading_path", "kv_offloading_path_size", "kv_pool",
                 "tensor_parallel_size", "distributed_init", "tensor_parallel_workers", "map_ahead_tokens", "speculative_config",
                 "num_scheduler_steps", "kv_events_config", "data_parallel_rank", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
        models = args.model if isinstance(args.model, list) else [args.model]
        if len(models) > 1:
            raise ValueError("several --model: only `vkv serve` serves several models (as NAME=SOURCE)")
        return cls(**{name: getattr(args, name) for name in names if name != "model"}, model=models[0] if models else None,
                   seed=args.model_seed)
