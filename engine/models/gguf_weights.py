"""A GGUF file's weights as it stores them: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K tensors stay in their blocks.

Rationale. Served through the dequantized checkpoint (loader.py), a GGUF at Q4_1 becomes fp32:
6.4x its bytes in memory, and every decode step reads 6.4x what the file holds. With
`quantization="gguf"` (vLLM's name for serving a GGUF file) the projections and the token
embedding keep the file's blocks, and the native kernels unpack them in registers
(ext/cpu/gguf_blocks.cpp, Note [GGUF weights as they are stored]); against Q8_0, Q4_0 and Q4_1
blocks, x is rounded to int8 blocks and the products summed in integers, as llama.cpp computes
(`GgufWeight.quantizes_x`). The model holds those with their rows interleaved by eight
(`GgufWeight.interleaved`: the same bytes, moved so that one load holds eight rows' weights; Note
[GGUF rows interleaved by eight]).

Approach. `read_gguf` maps the file's tensor names to the Hugging Face names the model loads,
keeps each Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K matrix as a `GgufWeight` (its rows' bytes, uint8
[N, K / block weights * block bytes], or interleaved by eight as they are copied out of the
file, and its type), and dequantizes the others with gguf-py
(norms in F32; the k-quants without a kernel here: Q2_K, Q3_K, Q5_K). llama.cpp's converter permutes the rows of Llama's and Mistral's
q and k projections for its rotary layout; transformers' loader undoes it on the values, and
here the same permutation moves whole rows of blocks, so both load the same matrix.

Limitations. CPU only, with the native kernels built (else the loader refuses it by name and
the dequantized checkpoint serves); the one-call decode step (multi-step too) takes blocks of 32
weights, and a model with k-quant projections decodes layer by layer; no sleep mode, weight updates, LoRA or tensor
parallelism over blocks (each refused by name); a fused projection whose parts differ in type (a Q4_K_M file's
Q6_K v beside Q4_K q and k, in some layers) is dequantized whole; the tokenizer and config
still come from the converted checkpoint directory.
"""
from __future__ import annotations

import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# ggml's Q4_0, Q4_1, Q8_0 (blocks of 32 weights), Q4_K and Q6_K (super-blocks of 256): id -> name
TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}

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
    (the file's layout), or [n / 8, k / 32, 8 x block bytes] with its rows interleaved by eight
    (`interleaved`); `type` ggml's id (one of TYPES)."""
    rows: torch.Tensor
    type: int
    k: int

    @property
    def type_name(self) -> str:
        return TYPES[self.type]

    @property
    def quantizes_x(self) -> bool:
        """Whether x meets it as int8 blocks with integer sums (llama.cpp's arithmetic for the
        32-weight blocks: ext/cpu/gguf_blocks.cpp, XBlocks); the k-quants multiply in fp32."""
        return self.type_name in ("Q8_0", "Q4_0", "Q4_1")

    @property
    def by_eight(self) -> bool:
        return self.rows.dim() == 3

    @property
    def n(self) -> int:
        return self.rows.shape[0] * (8 if self.by_eight else 1)

    def _parts(self) -> tuple[int, int, int, int]:
        """(blocks a row, bytes a block, fp16 values a block's head holds, quant bytes a block)."""
        size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[self.type_name]
        halves = 2 if self.type_name == "Q4_1" else 1
        return self.k // 32, size, halves, size - 2 * halves

    def interleaved(self) -> GgufWeight:
        """The rows interleaved by eight, as the kernels read them fastest (ext/cpu/gguf_blocks.cpp,
        Note [GGUF rows interleaved by eight]): the same bytes, moved. Itself where that layout does
        not apply (k-quants, n not a multiple of 8, already interleaved)."""
        if self.by_eight or not self.quantizes_x or self.n % 8:
            return self
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
    def cat(parts: list[GgufWeight]) -> GgufWeight | None:
        """Rows of several matrices of one type and width, one after another (a fused projection)."""
        if len({(p.type, p.k) for p in parts}) != 1:
            return None
        if all(p.by_eight for p in parts):  # (groups of eight rows follow one another as rows do)
            return GgufWeight(torch.cat([p.rows for p in parts]), parts[0].type, parts[0].k)
        return GgufWeight(torch.cat([p.plain().rows for p in parts]), parts[0].type, parts[0].k)


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
    except (IndexError, KeyError, TypeError, OverflowError, struct.error, EOFError) as exc:  # (and ValueError)
        raise ValueError(f"not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _read(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor | GgufWeight]:
    from gguf import GGMLQuantizationType, GGUFReader, quants

    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field else ""
    state: dict[str, torch.Tensor | GgufWeight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        kind = int(tensor.tensor_type)
        shape = [int(d) for d in reversed(tensor.shape.tolist())]  # GGUF lists the fastest dimension first
        if kind in TYPES and len(shape) == 2:
            data = np.asarray(tensor.data).view(np.uint8).reshape(shape[0], -1)
            with warnings.catch_warnings():  # (a view of the read-only file: copied once below)
                warnings.simplefilter("ignore", UserWarning)
                value: torch.Tensor | GgufWeight = GgufWeight(torch.from_numpy(data), kind, shape[1])
        else:
            array = np.asarray(tensor.data) if kind in (0, 1) else quants.dequantize(tensor.data, GGMLQuantizationType(kind))
            value = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        heads = {"q_proj": num_heads, "k_proj": num_kv_heads}.get(name.split(".")[-2])
        if arch in ("llama", "mistral") and heads and name.endswith("weight"):
            order = torch.from_numpy(unpermute_rows(shape[0], heads))
            value = (GgufWeight(value.rows[order].contiguous(), value.type, value.k) if isinstance(value, GgufWeight)
                     else value[order].contiguous())
        if isinstance(value, GgufWeight):  # copied out of the file once, interleaved where it applies
            interleaved = value.interleaved()
            value = interleaved if interleaved is not value else GgufWeight(value.rows.clone(), value.type, value.k)
        state[name] = value
    return state
