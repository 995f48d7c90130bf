"""A GGUF file's weights as it stores them: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors stay in their blocks.

Rationale. Served through the dequantized checkpoint (loader.py), a GGUF at Q4_1 becomes fp32:
6.4x its bytes in memory, and every decode step reads 6.4x what the file holds. With
`quantization="gguf"` (vLLM's name for serving a GGUF file) the projections and the token
embedding keep the file's blocks, and the native kernels unpack them in registers
(ext/cpu/gguf_blocks.cpp, Note [GGUF weights as they are stored]); x is rounded to int8 blocks
and the products summed in integers, as llama.cpp computes (`GgufWeight.quantizes_x`). The model
holds the weights with their rows interleaved by eight (`GgufWeight.interleaved`: the file's
bits, moved so that one load holds eight rows' weights; Notes [GGUF rows interleaved by eight]
and [K-quants interleaved by eight]).

Approach. `read_gguf` maps the file's tensor names (found by gguf_file.py) to the Hugging Face
names, keeps each Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K matrix as a `GgufWeight` (its rows' bytes, uint8
[N, K / block weights * block bytes], or interleaved by eight as they are copied out of the
file, and its type), and dequantizes the others with gguf-py
(norms in F32; the k-quants without a kernel here: Q2_K, Q3_K, Q5_K). llama.cpp's converter permutes the rows of Llama's and Mistral's
q and k projections for its rotary layout; transformers' loader undoes it on the values, and
here the same permutation moves whole rows of blocks, so both load the same matrix.

Limitations. CPU only, with the native kernels built (else the loader refuses it by name and
the dequantized checkpoint serves; by default, so does a file whose matrices are mostly of other
types: `mostly_in_blocks`); k-quant rows interleave only where a matrix has a multiple
of 8 rows (else they multiply in fp32, and the model decodes layer by layer); no sleep mode,
weight updates, LoRA or tensor parallelism over blocks (each refused by name); a fused projection
whose parts differ in type (a Q4_K_M file's Q6_K v beside Q4_K q and k, in some layers) is a
`GgufStack`, which the one-call step takes only for qkv in two parts (else the model decodes
layer by layer); the tokenizer and config still come from the converted checkpoint directory.
A prompt's rows (one int8 GEMM) and a decode step's row (the one-row kernels) sum their blocks'
products in other orders: the same token's K and V can differ in the last bits, so a sequence
recomputed after preemption (or verified with speculation after it) may take another token at a
near tie, where the dequantized checkpoint's outputs do not change.
"""
from __future__ import annotations

import functools
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.models.gguf_file import PLAIN, read_gguf_file

# ggml's Q4_0, Q4_1, Q8_0 (blocks of 32 weights), Q4_K and Q6_K (super-blocks of 256): id -> name
TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}

# llama.cpp's Llama 3 files carry the rope's frequency factors, which the model computes from the
# config's rope_scaling (as transformers' conversion does, which skips them too)
SKIPPED = {"rope_freqs.weight"}
NAMES = [  # the file's name -> the Hugging Face name
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", r"model.layers.\1.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", r"model.layers.\1.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


@dataclass
class GgufWeight:
    """A matrix [n, k] in a GGUF file's blocks: `rows` uint8 [n, k / block weights * block bytes]
    (the file's layout), or [n / 8, k / block weights, group bytes] with its rows interleaved by
    eight (`interleaved`); `type` ggml's id (one of TYPES)."""
    rows: torch.Tensor
    type: int
    k: int

    @property
    def type_name(self) -> str:
        return TYPES[self.type]

    @property
    def quantizes_x(self) -> bool:
        """Whether x meets it as int8 blocks with integer sums (llama.cpp's arithmetic:
        ext/cpu/gguf_blocks.cpp, XBlocks): the 32-weight blocks always, the k-quants with their rows
        interleaved (else they multiply in fp32)."""
        return self.type_name in ("Q8_0", "Q4_0", "Q4_1") or self.by_eight

    @property
    def k_quant(self) -> bool:
        return self.type_name in ("Q4_K", "Q6_K")

    @property
    def by_eight(self) -> bool:
        return self.rows.dim() == 3

    @property
    def n(self) -> int:
        return self.rows.shape[0] * (8 if self.by_eight else 1)

    def step_view(self) -> torch.Tensor:
        """The rows as the native decode step reads them: [n, k / 32, block bytes] for rows of
        blocks of 32 as the file lays them out, else `rows` (interleaved: [n / 8, k / block weights,
        group bytes]); the last size names the type (ext/cpu/gguf_blocks.cpp, blocks_type). A
        k-quant's rows must be interleaved: as the file lays them out, a Q4_K super-block's 144
        bytes would read as eight Q4_0 rows interleaved."""
        if self.k_quant and not self.by_eight:
            raise ValueError(f"{self.type_name} rows reach the native step interleaved by eight only")
        return self.rows if self.by_eight else self.rows.view(self.n, self.k // 32, -1)

    def _parts(self) -> tuple[int, int, int, int]:
        """(blocks a row, bytes a block, fp16 values a block's head holds, quant bytes a block)."""
        size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[self.type_name]
        halves = 2 if self.type_name == "Q4_1" else 1
        return self.k // 32, size, halves, size - 2 * halves

    def interleaved(self) -> GgufWeight:
        """The rows interleaved by eight, as the kernels read them fastest (ext/cpu/gguf_blocks.cpp,
        Notes [GGUF rows interleaved by eight], [K-quants interleaved by eight]): the file's bits,
        moved. Itself where n is not a multiple of 8, or already interleaved."""
        if self.by_eight or self.n % 8:
            return self
        if self.k_quant:
            return GgufWeight(_k_interleaved(self.rows, self.type_name, self.n, self.k), self.type, self.k)
        blocks, size, halves, quants = self._parts()
        a = self.rows.view(self.n // 8, 8, blocks, size)
        groups = torch.empty(self.n // 8, blocks, 8 * size, dtype=torch.uint8)  # (one copy, no intermediates)
        groups[..., :16 * halves].view(-1, blocks, halves, 8, 2).copy_(
            a[..., :2 * halves].view(-1, 8, blocks, halves, 2).permute(0, 2, 3, 1, 4))
        groups[..., 16 * halves:].view(-1, blocks, quants // 4, 8, 4).copy_(
            a[..., 2 * halves:].view(-1, 8, blocks, quants // 4, 4).permute(0, 2, 3, 1, 4))
        return GgufWeight(groups, self.type, self.k)

    def plain(self) -> GgufWeight:
        """The rows as the file lays them out (`interleaved` undone)."""
        if not self.by_eight:
            return self
        if self.k_quant:
            return GgufWeight(_k_plain(self.rows, self.type_name, self.n, self.k), self.type, self.k)
        blocks, size, halves, quants = self._parts()
        g = self.rows
        rows = torch.empty(self.n // 8, 8, blocks, size, dtype=torch.uint8)
        rows[..., :2 * halves].view(-1, 8, blocks, halves, 2).copy_(
            g[..., :16 * halves].view(-1, blocks, halves, 8, 2).permute(0, 3, 1, 2, 4))
        rows[..., 2 * halves:].view(-1, 8, blocks, quants // 4, 4).copy_(
            g[..., 16 * halves:].view(-1, blocks, quants // 4, 8, 4).permute(0, 3, 1, 2, 4))
        return GgufWeight(rows.view(self.n, blocks * size), self.type, self.k)

    def dequantized(self) -> torch.Tensor:
        """[n, k] fp32, as gguf-py's `dequantize` gives it (the format's definition)."""
        from gguf import GGMLQuantizationType, quants
        rows = self.plain().rows.numpy()
        return torch.from_numpy(quants.dequantize(rows, GGMLQuantizationType(self.type)).copy())

    @staticmethod
    def cat(parts: list[GgufWeight]) -> GgufWeight | GgufStack:
        """Rows of several matrices of one width, one after another (a fused projection): one
        weight where they share a type, else a GgufStack of the runs that do."""
        if len({p.k for p in parts}) != 1:
            raise ValueError(f"fused GGUF weights of widths {sorted({p.k for p in parts})}")
        runs: list[list[GgufWeight]] = []
        for p in parts:
            if runs and runs[-1][0].type == p.type:
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) > 1:
            return GgufStack([GgufWeight.cat(run) for run in runs])
        if all(p.by_eight for p in parts):  # (groups of eight rows follow one another as rows do)
            return GgufWeight(torch.cat([p.rows for p in parts]), parts[0].type, parts[0].k)
        return GgufWeight(torch.cat([p.plain().rows for p in parts]), parts[0].type, parts[0].k)


@dataclass
class GgufStack:
    """A fused projection whose parts a file quantized differently (a Q4_K_M file's Q6_K v beside
    Q4_K q and k): the rows of each part in its own GgufWeight, one after another, each run by its
    own kernel into its own outputs (Linear.forward; decode_layers takes the second as a tail)."""
    parts: list[GgufWeight]

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def type_name(self) -> str:
        return " + ".join(p.type_name for p in self.parts)

    @property
    def quantizes_x(self) -> bool:
        return all(p.quantizes_x for p in self.parts)

    def interleaved(self) -> GgufStack:
        return GgufStack([p.interleaved() for p in self.parts])

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


def _by_eight(x: torch.Tensor) -> torch.Tensor:
    """[n / 8, 8 rows, supers, parts, 8 k, 4 bytes] -> [n / 8, supers, parts, 8 k, 8 rows, 4 bytes]:
    four bytes of each of eight rows side by side (Note [K-quants interleaved by eight])."""
    return x.permute(0, 2, 3, 4, 1, 5)


def _k_interleaved(rows: torch.Tensor, type_name: str, n: int, k: int) -> torch.Tensor:
    """Q4_K or Q6_K rows [n, k / 256 * block bytes] as eight rows' super-blocks, [n / 8, k / 256,
    1184 or 1680] (ext/cpu/gguf_blocks.cpp, Note [K-quants interleaved by eight])."""
    supers = k // 256
    if type_name == "Q4_K":
        a = rows.view(n // 8, 8, supers, 144)
        out = torch.empty(n // 8, supers, 1184, dtype=torch.uint8)
        out[..., :16].view(-1, supers, 8, 2).copy_(a[..., 0:2].permute(0, 2, 1, 3))
        out[..., 16:32].view(-1, supers, 8, 2).copy_(a[..., 2:4].permute(0, 2, 1, 3))
        s = a[..., 4:16].to(torch.int32)  # ggml's 6-bit scales and mins (get_scale_min_k4)
        scale = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
        low = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
        out[..., 32:96].view(-1, supers, 8, 8).copy_(scale.permute(0, 2, 3, 1))
        out[..., 96:160].view(-1, supers, 8, 8).copy_(low.permute(0, 2, 3, 1))
        out[..., 160:].view(-1, supers, 4, 8, 8, 4).copy_(_by_eight(a[..., 16:].reshape(n // 8, 8, supers, 4, 8, 4)))
        return out
    a = rows.view(n // 8, 8, supers, 210)
    out = torch.empty(n // 8, supers, 1680, dtype=torch.uint8)
    out[..., :16].view(-1, supers, 8, 2).copy_(a[..., 208:210].permute(0, 2, 1, 3))
    out[..., 16:144].view(-1, supers, 16, 8).copy_(a[..., 192:208].permute(0, 2, 3, 1))
    q = _q6(a[..., :128], a[..., 128:192]).view(n // 8, 8, supers, 8, 32)  # 6 bits, the blocks of 32 in order
    low = (q[..., 0::2, :] & 15) | ((q[..., 1::2, :] & 15) << 4)  # [.., 4 pairs, 32]
    high = (q >> 4).view(n // 8, 8, supers, 2, 4, 32)
    high = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
    out[..., 144:1168].view(-1, supers, 4, 8, 8, 4).copy_(_by_eight(low.view(n // 8, 8, supers, 4, 8, 4)))
    out[..., 1168:].view(-1, supers, 2, 8, 8, 4).copy_(_by_eight(high.view(n // 8, 8, supers, 2, 8, 4)))
    return out


def _q6(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's 256 quants of 6 bits, in the weights' order, from ql [.., 128] and qh [.., 64] (as
    gguf-py's Q6_K.dequantize_blocks reads them)."""
    shape = ql.shape[:-1]
    low = torch.stack([ql.view(*shape, 2, 64) & 15, ql.view(*shape, 2, 64) >> 4], dim=-2)
    high = torch.stack([(qh.view(*shape, 2, 32) >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)
    return low.reshape(*shape, 256) | (high.reshape(*shape, 256) << 4)


def _k_plain(groups: torch.Tensor, type_name: str, n: int, k: int) -> torch.Tensor:
    """`_k_interleaved` undone: the file's rows [n, k / 256 * block bytes]."""
    supers = k // 256
    unmix = lambda g, parts: g.view(n // 8, supers, parts, 8, 8, 4).permute(0, 4, 1, 2, 3, 5)  # noqa: E731
    if type_name == "Q4_K":
        rows = torch.empty(n // 8, 8, supers, 144, dtype=torch.uint8)
        rows[..., 0:2].copy_(groups[..., :16].view(-1, supers, 8, 2).permute(0, 2, 1, 3))
        rows[..., 2:4].copy_(groups[..., 16:32].view(-1, supers, 8, 2).permute(0, 2, 1, 3))
        scale = groups[..., 32:96].view(-1, supers, 8, 8).permute(0, 3, 1, 2).to(torch.int32)
        low = groups[..., 96:160].view(-1, supers, 8, 8).permute(0, 3, 1, 2).to(torch.int32)
        packed = torch.cat([scale[..., :4] | ((scale[..., 4:] >> 4) << 6), low[..., :4] | ((low[..., 4:] >> 4) << 6),
                            (scale[..., 4:] & 15) | ((low[..., 4:] & 15) << 4)], dim=-1)
        rows[..., 4:16].copy_(packed.to(torch.uint8))
        rows[..., 16:].view(-1, 8, supers, 4, 8, 4).copy_(unmix(groups[..., 160:], 4))
        return rows.view(n, supers * 144)
    rows = torch.empty(n // 8, 8, supers, 210, dtype=torch.uint8)
    rows[..., 208:210].copy_(groups[..., :16].view(-1, supers, 8, 2).permute(0, 2, 1, 3))
    rows[..., 192:208].copy_(groups[..., 16:144].view(-1, supers, 16, 8).permute(0, 3, 1, 2))
    low = unmix(groups[..., 144:1168], 4).reshape(n // 8, 8, supers, 4, 32)
    high = unmix(groups[..., 1168:], 2).reshape(n // 8, 8, supers, 2, 1, 32)
    high = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [.., 2, 4, 32]
    q = torch.stack([low & 15, low >> 4], dim=-2).view(n // 8, 8, supers, 256) | (high.reshape(n // 8, 8, supers, 256) << 4)
    halves = q.view(n // 8, 8, supers, 2, 4, 32)  # weight h * 128 + s * 32 + i
    ql = (halves[..., 0:2, :] & 15) | ((halves[..., 2:4, :] & 15) << 4)  # byte h * 64 + i: weights i, i + 64
    qh = (halves >> 4)
    qh = qh[..., 0, :] | (qh[..., 1, :] << 2) | (qh[..., 2, :] << 4) | (qh[..., 3, :] << 6)
    rows[..., :128].copy_(ql.reshape(n // 8, 8, supers, 128))
    rows[..., 128:192].copy_(qh.reshape(n // 8, 8, supers, 64))
    return rows.view(n, supers * 210)


def mostly_in_blocks(path: Path) -> bool:
    """Whether most of a GGUF's matrix bytes are of a type its blocks serve (TYPES): a Q4_K_M or
    Q8_0 file is; a Q5_K_M or F16 file is not (its matrices would be dequantized at every start,
    where the converted checkpoint is dequantized once and cached). False for a file that does
    not read as a GGUF (its conversion then says what is wrong). Read once per version of the
    file (the config asks several times a start)."""
    try:
        stat = path.stat()
    except OSError:
        return False
    return _mostly_in_blocks(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _mostly_in_blocks(path: str, mtime_ns: int, size: int) -> bool:
    try:
        tensors = [t for t in read_gguf_file(Path(path)).tensors if len(t.dims) == 2]
    except (OSError, ValueError):
        return False
    served = sum(t.data.nbytes for t in tensors if t.type in TYPES)
    return 2 * served > sum(t.data.nbytes for t in tensors)


def hf_name(name: str) -> str:
    for pattern, replacement in NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise ValueError(f"tensor {name!r} has no place in a Llama-family model")


def unpermute_rows(n: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a q or k projection of n rows
    over `heads` heads (transformers' `reverse_permute_weights`, on row indices)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def read_gguf(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor | GgufWeight]:
    """The file's weights by Hugging Face name: a GgufWeight for each matrix of a type in TYPES,
    an fp32 tensor for everything else."""
    try:
        return _read(path, num_heads, num_kv_heads)
    except (IndexError, KeyError, TypeError, OverflowError, struct.error, EOFError,
            RecursionError) as exc:  # (and ValueError)
        raise ValueError(f"not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _read(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor | GgufWeight]:
    from gguf import GGMLQuantizationType, quants

    file = read_gguf_file(path)
    state: dict[str, torch.Tensor | GgufWeight] = {}
    for tensor in file.tensors:
        if tensor.name in SKIPPED:
            continue
        name = hf_name(tensor.name)
        kind = tensor.type
        shape = [int(d) for d in reversed(tensor.dims)]
        if kind in TYPES and len(shape) == 2:
            data = tensor.data.view(np.uint8).reshape(shape[0], -1)
            with warnings.catch_warnings():  # (a view of the read-only file: copied once below)
                warnings.simplefilter("ignore", UserWarning)
                value: torch.Tensor | GgufWeight = GgufWeight(torch.from_numpy(data), kind, shape[1])
        else:
            array = tensor.data if kind in PLAIN else quants.dequantize(tensor.data, GGMLQuantizationType(kind))
            value = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(name.split(".")[-2])
        if file.architecture in ("llama", "mistral") and heads and name.endswith("weight"):
            order = torch.from_numpy(unpermute_rows(shape[0], heads))
            value = (GgufWeight(value.rows[order].contiguous(), value.type, value.k) if isinstance(value, GgufWeight)
                     else value[order].contiguous())
        if isinstance(value, GgufWeight):  # copied out of the file once, interleaved where it applies
            interleaved = value.interleaved()
            value = interleaved if interleaved is not value else GgufWeight(value.rows.clone(), value.type, value.k)
        state[name] = value
    return state
