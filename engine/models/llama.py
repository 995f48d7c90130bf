"""The Llama family in one file: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

The model runs on a flat batch of tokens from many sequences at once (no padding). Each layer
does, in order, the same arithmetic as Hugging Face's modules:

    x, residual = add_rms_norm(x, residual)      residual += x; x = norm(residual)
    q, k, v = qkv_proj(x)                        one GEMM for the three projections
    x = o_proj(attn(layer, q, k, v))             rotary embedding, K/V stored, attention
    x, residual = add_rms_norm(x, residual)
    x = down_proj(silu_and_mul(gate_up_proj(x))) one GEMM for gate and up

Checkpoints load as they are (`load_checkpoint` fuses q/k/v and gate/up once). The small fused
operations run native on the CPU where the kernels build (engine/models/ops.py).

Tensor parallelism (`shard`, Megatron's split): each rank keeps its share of the query and KV
heads (q/k/v rows, o_proj columns) and of the MLP (gate/up rows, down_proj columns); o_proj
and down_proj outputs are partial sums, all-reduced over the group. Embeddings and the LM head
are whole on every rank, and only rank 0 computes logits.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

import ext
import vmm
from engine.models import ops
from engine.models.config import ModelConfig
from engine.models.gguf_weights import GgufStack, GgufWeight
from engine.models.huge_pages import huge_page_slots, onto_huge_pages
from engine.models.linear import FEW_ROWS, Linear
from engine.models.weight_pages import WeightPages

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm(x, residual, self.weight, self.eps, native)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim)
    if cfg.rope_scaling:  # Llama 3: stretch low frequencies, keep high ones, blend between
        s = cfg.rope_scaling
        factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, blended))
    return inv_freq.float()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads = layer, cfg.num_heads, cfg.num_kv_heads
        self.head_dim = d = cfg.head_dim
        self.split = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.split), bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def shard(self, rank: int, world: int) -> None:
        """Keep this rank's query heads and the KV heads they read (GQA groups stay whole)."""
        nq, nk, _ = self.split
        q, k, v = (part.chunk(world)[rank] for part in self.qkv_proj.weight.data.split(self.split))
        self.qkv_proj.weight.data = torch.cat([q, k, v])
        if self.qkv_proj.bias is not None:
            parts = (part.chunk(world)[rank] for part in self.qkv_proj.bias.data.split(self.split))
            self.qkv_proj.bias.data = torch.cat(list(parts))
        self.o_proj.weight.data = self.o_proj.weight.data.chunk(world, dim=1)[rank]
        self.num_heads, self.num_kv_heads = self.num_heads // world, self.num_kv_heads // world
        self.split = (nq // world, nk // world, nk // world)

    def forward(self, x: torch.Tensor, attn, lora=None) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        if lora:
            lora.add(self.layer, "qkv_proj", x, qkv)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm.forward(q.contiguous())[0], self.k_norm.forward(k.contiguous())[0]
        out = attn(self.layer, q, k, v).view(-1, self.num_heads * self.head_dim)
        o = self.o_proj.forward(out)
        return all_reduce(lora.add(self.layer, "o_proj", out, o) if lora else o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def shard(self, rank: int, world: int) -> None:
        gate, up = self.gate_up_proj.weight.data.chunk(2)
        self.gate_up_proj.weight.data = torch.cat([gate.chunk(world)[rank], up.chunk(world)[rank]])
        self.down_proj.weight.data = self.down_proj.weight.data.chunk(world, dim=1)[rank]

    def forward(self, x: torch.Tensor, native: bool, lora=None) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if lora:
            lora.add(self.layer, "gate_up_proj", x, gate_up)
        h = ops.silu_and_mul(gate_up, native)
        down = self.down_proj.forward(h)
        return all_reduce(lora.add(self.layer, "down_proj", h, down) if lora else down)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum a row-parallel projection's partial outputs over the tensor-parallel group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg, layer)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decode_weights(self) -> tuple:
        """The layer's weights as the native `decode_layers` takes them (the projections' panels or
        GGUF blocks: Linear.step_weight; norms and bias in fp32: copies under bf16 arithmetic, which
        `weights.apply` makes again)."""
        a, m = self.self_attn, self.mlp
        bias = None if a.qkv_proj.bias is None else a.qkv_proj.bias.float()
        return (self.input_layernorm.weight.float(), self.post_attention_layernorm.weight.float(),
                self.input_layernorm.eps, a.qkv_proj.step_weight()[0], a.qkv_proj.step_tail(), bias,
                a.o_proj.step_weight()[0], m.gate_up_proj.step_weight()[0], m.down_proj.step_weight()[0],
                a.num_heads, a.num_kv_heads)

    def forward(self, x, residual, attn, native: bool, lora=None):
        x, residual = self.input_layernorm.forward(x, residual, native)
        x = self.self_attn.forward(x, attn, lora)
        x, residual = self.post_attention_layernorm.forward(x, residual, native)
        return self.mlp.forward(x, native, lora), residual


def fuse(parts: list[torch.Tensor | GgufWeight]) -> torch.Tensor | GgufWeight | GgufStack:
    """Rows of several projections as one: blocks kept where all are blocks (a GgufStack where
    their types differ), else fp32."""
    if all(isinstance(p, GgufWeight) for p in parts):
        return GgufWeight.cat(parts)
    return torch.cat([p.dequantized() if isinstance(p, GgufWeight) else p for p in parts])


class GgufEmbedding(nn.Module):
    """A token embedding kept in a GGUF file's blocks: each lookup unpacks its rows."""

    def __init__(self, weight: GgufWeight):
        super().__init__()
        self.gguf, self.embedding_dim = weight, weight.k
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)  # (its dtype: the output's)

    def step_rows(self) -> torch.Tensor:
        """The rows as multi-step decode reads them (GgufWeight.step_view)."""
        return self.gguf.step_view()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).long().contiguous()
        out = torch.empty(ids.shape[0], self.embedding_dim)
        torch.ops.vkv.dequantize_gguf(self.gguf.rows, self.gguf.type, ids, out)
        return out.view(*input_ids.shape, self.embedding_dim).to(self.weight.dtype)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # (its weight given, so no init runs: on the meta device torch's normal_ imports torch._dynamo, 2.8 s;
        # the loader writes every weight)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.tie(self.model.embed_tokens.weight)
        self.inv_freq = rope_inv_freq(cfg)  # fp32 on purpose: not a buffer, so .to(dtype) skips it
        self.native = False  # run the native small ops (set by `prepare`)
        self.decode: list[tuple] = []  # per layer, the weights of the one-call decode path (set by `prepare`)
        self.multi_step = False  # whether that path can also run several greedy steps (`greedy_steps`)
        self.gemm_path = "torch F.linear"  # what the projections run on (set by `prepare`)
        self.rank = 0  # tensor-parallel rank: only rank 0 computes logits
        self.sharded = False  # a tensor-parallel shard (`shard`)
        self.weights_dtype = self.compute_dtype = torch.float32  # what the weights are rounded to, and computed in (`prepare`)
        self.weights_version = 0  # updates written in place since load (engine/models/weights.py `apply`)
        self.fingerprint = b""  # what the weights are (loader.py `load_model`; a fresh random one after `apply`)
        self.pages: WeightPages | None = None  # the weights in pages that sleep (sleep mode; set by `prepare`)

    def load_checkpoint(self, state: dict[str, torch.Tensor | GgufWeight]) -> None:
        """Load a Hugging Face state dict: q/k/v and gate/up projections are fused here. A matrix
        given as a GgufWeight (engine/models/gguf_weights.py) stays in its blocks."""
        state = dict(state)
        for i in range(self.config.num_layers):
            pre = f"model.layers.{i}."
            for fused, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                                 ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"))):
                for kind in ("weight", "bias"):
                    names = [f"{pre}{p}.{kind}" for p in parts]
                    if all(n in state for n in names):
                        state[f"{pre}{fused}.{kind}"] = fuse([state.pop(n) for n in names])
        blocks = {name: state.pop(name) for name in list(state) if isinstance(state[name], (GgufWeight, GgufStack))}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            blocks.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if k not in blocks and not (self.config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not fit a {self.config.model_type} model "
                             f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
        for name, weight in blocks.items():
            weight = weight.interleaved()  # (as the kernels read it fastest; the same bytes)
            if name == "model.embed_tokens.weight":
                if (weight.n, weight.k) != (self.config.vocab_size, self.config.hidden_size):
                    raise ValueError(f"a {weight.n} x {weight.k} GGUF token embedding for a "
                                     f"{self.config.vocab_size} x {self.config.hidden_size} model")
                self.model.embed_tokens = GgufEmbedding(weight)
            else:
                self.get_submodule(name.removesuffix(".weight")).hold_gguf(weight)
        if self.config.tie_word_embeddings:
            if isinstance(self.model.embed_tokens, GgufEmbedding):
                self.lm_head.hold_gguf(self.model.embed_tokens.gguf)
            else:
                self.lm_head.tie(self.model.embed_tokens.weight)

    @property
    def gguf_blocks(self) -> bool:
        """Whether any weight stays in a GGUF file's blocks."""
        return any(getattr(m, "gguf", None) is not None for m in self.modules())

    def shard(self, rank: int, world: int) -> None:
        """Keep rank's share of every layer (see the note above); before `prepare`. A shard's
        layers all-reduce inside, so they never run as one native call."""
        self.sharded = world > 1
        for layer in self.model.layers:
            layer.self_attn.shard(rank, world)
            layer.mlp.shard(rank, world)
        self.rank = rank

    def prepare(self, device: torch.device, dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                sleep_mode: bool = False, greedy_pick: bool = False) -> LlamaForCausalLM:
        """Move to the device and dtype, then put every projection's weight in the layout its
        GEMM runs fastest from, and decide whether the native small ops run. With a wider
        compute_dtype (bf16 weights on a CPU that computes bf16 in fp32), the weights are
        rounded to dtype and then widened, so the model computes with dtype's values. With
        sleep_mode, the weights then move into pages that sleep (engine/models/weight_pages.py). With
        greedy_pick (multi-step decode on), the LM head keeps a copy of its panels in half the bytes (bf16
        beside fp32, int8 beside bf16), from which the one-call path's greedy steps pick each token
        exactly (ext/cpu/greedy_pick.cpp)."""
        compute_dtype = compute_dtype or dtype
        self.weights_dtype, self.compute_dtype = dtype, compute_dtype
        self.to(device=device, dtype=dtype)
        if compute_dtype != dtype:
            self.to(dtype=compute_dtype)
        self.eval()
        self.native = ops.native(device) is not None and compute_dtype in (torch.float32, torch.bfloat16)
        blocks = self.gguf_blocks  # (no panels for them; no huge pages: those move panels only)
        if blocks and not (self.native and device.type == "cpu"):
            raise ValueError("weights in GGUF blocks need the CPU and vkv's native kernels "
                             f"({ext.cpu_kernels_error() or 'not on this device'}); "
                             "serve the file without quantization='gguf'")
        if blocks and (sleep_mode or self.sharded):
            raise ValueError("weights in GGUF blocks: no sleep mode or tensor parallelism yet")
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        bf16 = self.native and compute_dtype == torch.bfloat16 and not self.sharded and not blocks
        dot = bf16 and device.type == "cpu" and ext.bf16_dot_gemm()[0]  # bf16 steps on the panels alone
        panels = (self.native and compute_dtype == torch.float32) or dot  # vkv's GEMM (engine/models/linear.py)
        beside = bf16 and not dot and self._fits(linears, dtype)  # decode's bf16 panels beside oneDNN's
        # decode_layers runs every norm, the last one's too, under one eps
        norms = [self.model.norm, *(n for layer in self.model.layers
                                    for n in (layer.input_layernorm, layer.post_attention_layernorm))]
        # (a step takes GGUF blocks as Linear serves them, x rounded to int8; q, k and v in two types at most)
        steps_blocks = all(m.gguf is None or m.gguf.quantizes_x for m in linears) and all(
            not isinstance(m.gguf, GgufStack) or (len(m.gguf.parts) == 2 and m is layer.self_attn.qkv_proj)
            for layer in self.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_up_proj, layer.mlp.down_proj))
        one_call = (panels or beside) and not self.config.qk_norm and not self.sharded \
            and len({norm.eps for norm in norms}) == 1 and steps_blocks
        slots, huge = [None] * len(linears), None  # (the panels written straight onto huge pages, where had)
        if (panels or beside) and device.type == "cpu" and not blocks:  # before sleep mode's move
            got, huge = huge_page_slots([(m.panels_shape(), dtype) for m in linears])
            slots = got or slots
        for module, slot in zip(linears, slots) if beside else ():
            module.pack_panels(dtype, drop=False, into=slot)
        paths = sorted({module.pack_panels(dtype, into=slot, dot=dot) if panels else module.pack()
                        for module, slot in zip(linears, slots)})
        if greedy_pick and one_call and not blocks:  # multi-step decode picks from half the LM head's bytes
            self.lm_head.pack_pick()
            onto_huge_pages([self.lm_head.pick])  # (its own arena; 4 KiB pages where under 2 MiB)
        if huge:
            paths.append(huge)
        if sleep_mode:  # before anything takes views of the weights
            self.pages = WeightPages(self, vmm.make_backend("cuda" if device.type == "cuda" else "host-private",
                                                            device=device.index or 0))
        if one_call:
            self.decode = [layer.decode_weights() for layer in self.model.layers]
            embed = self.model.embed_tokens
            self.multi_step = not isinstance(embed, GgufEmbedding) or embed.gguf.quantizes_x  # (rows read in C++)
        self.gemm_path = "; ".join(paths) + (f" (steps of <= {FEW_ROWS} rows: every layer in one native call"
                                             + (", bf16 panels in fp32 arithmetic" if beside else "") + ")"
                                             if self.decode else "")
        return self

    @staticmethod
    def _fits(linears: list[Linear], dtype: torch.dtype) -> bool:
        """Whether a second copy of the projections (decode's panels beside oneDNN's weights)
        takes at most a quarter of the memory available now."""
        need = sum(m.weight.numel() for m in linears) * torch.empty((), dtype=dtype).element_size()
        try:
            with open("/proc/meminfo") as f:
                available = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable"))
        except (OSError, StopIteration):
            return False
        return need <= available // 4

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attn, logits_indices: torch.Tensor, lora=None) -> torch.Tensor:
        """Logits of the tokens at `logits_indices` (each sequence's last scheduled token).
        `attn(layer, q, k, v)` rotates, stores the new K/V and attends over the cached context;
        `lora` (engine/worker/lora.py LoRABatch), if any, adds its rows' adapter deltas to the projections."""
        x, residual = self.model.embed_tokens.forward(input_ids), None  # no hooks: .forward, not __call__
        args = self._one_call(input_ids, attn) if lora is None else None
        if args is not None:  # a few rows: every layer, the last norm and the LM head in one native call
            logits = torch.empty(logits_indices.shape[0], self.lm_head.step_weight()[1])
            self._decode_layers(x, args, logits_indices, logits)
            return logits  # (bf16: rounded where the layer-by-layer path's bf16 tensors round them)
        for layer in self.model.layers:
            x, residual = layer.forward(x, residual, attn, self.native, lora)
        if self.rank:
            return None
        x, _ = self.model.norm.forward(x[logits_indices], residual[logits_indices], self.native)  # rows that sample
        return self.lm_head.forward(x).float()

    @torch.inference_mode()
    def greedy_steps(self, input_ids: torch.Tensor, attn, steps: int, stop_ids: list[int]) -> torch.Tensor | None:
        """Multi-step decode: each row (a sequence's last token) then `steps` greedy tokens in one
        native call, each fed back as the next step's input, as `steps` calls of `forward` and an
        argmax would pick them; [steps, rows] int64, -1 after the step where every row has picked
        one of stop_ids, -2 where a row's logits were not finite. None where the one-call path
        cannot run the step (then nothing was computed)."""
        args = self._one_call(input_ids, attn) if self.multi_step else None
        if args is None:
            return None
        rows, head, embed = input_ids.shape[0], self.lm_head, self.model.embed_tokens
        rows_of = embed.step_rows() if isinstance(embed, GgufEmbedding) else embed.weight
        tokens = torch.empty(steps, rows, dtype=torch.long)
        self._decode_layers(embed.forward(input_ids), args, torch.arange(rows),
                            torch.empty(rows, head.step_weight()[1]), rows_of, tokens,
                            torch.tensor(stop_ids, dtype=torch.long), head.pick, head.pick_bounds, head.pick_scales)
        return tokens

    def _one_call(self, input_ids: torch.Tensor, attn) -> tuple | None:
        """The step's arguments of the native `decode_layers`, or None where it cannot run them (too
        many rows, or no native step: another kernel, or a sliding window, which runs on sdpa)."""
        step = getattr(attn, "native_args", None) if self.decode and input_ids.shape[0] <= FEW_ROWS else None
        return step() if step is not None else None

    def _decode_layers(self, x: torch.Tensor, args: tuple, rows: torch.Tensor, logits: torch.Tensor,
                       *greedy: torch.Tensor) -> None:
        norms_in, norms_post, eps, qkv, qkv_tails, qkv_bias, o, gate_up, down, heads, kv_heads = zip(*self.decode)
        torch.ops.vkv.decode_layers(x.float(), torch.empty(x.shape, dtype=torch.float32), norms_in, norms_post, eps[0],
                                    qkv, qkv_tails, qkv_bias, o, gate_up, down, heads[0], kv_heads[0], *args, rows,
                                    self.model.norm.weight, self.lm_head.step_weight()[0],
                                    self.compute_dtype == torch.bfloat16,
                                    logits, *greedy)
