"""Linear projections with their weights kept in the layout the device's fastest GEMM reads.

On the CPU (fp32, bf16) the weight is reordered once into oneDNN's blocked layout, the path
inductor's weight freezing takes (`torch.ops.mkldnn._reorder_linear_weight` with a batch-size
hint, then `_linear_pointwise`); the plain weight is dropped unless something else holds it (a
tied embedding). The batch-size hint matters: below 32, every row count runs several times
slower (benchmarks/results/cpu/design_choices.json, "onednn_packed").

Decode steps of a few rows are bound by reading the weights, and there oneDNN's packed GEMM
reads them slowly (benchmarks/results/cpu/design_choices.json, "onednn_slow_rows"). Steps of
more rows (decode batches, prefill) are bound by arithmetic, and there both oneDNN's packed
GEMM and the panel GEMM below run near the FMA peak. With the native kernels built and fp32
arithmetic, the weight is instead packed into column panels for vkv's register-tiled
GEMM (ext: `linear_panels`), which replaces oneDNN's copy (no more memory) and serves every
step (`benchmarks/bench_gemm.py` measures it against oneDNN at 1 to 512 rows), and at one row
each thread streams its run of panels front to back, faster than a kernel streaming the plain
rows (design_choices.json, "panels"). Panels of bf16 weights stay bf16 (widened on load: half the
bytes). Where bf16 arithmetic is native, decode steps of at most FEW_ROWS rows stream bf16 panels
in fp32 arithmetic (bf16 x bf16 products are exact in fp32; design_choices.json,
"bf16_decode_on_panels"), and steps of more rows, bound by arithmetic, run in bf16 arithmetic:
with AVX512-BF16 and no AMX, over the same panels in the CPU's bf16 dot products (`dot`: one
packing, ext/cpu/panels.h's Note [bf16 steps in bf16 dot products]); with AMX, in oneDNN's
packed bf16 GEMM, whose weight is kept beside the panels. On a GPU, torch runs as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.gguf_weights import GgufStack, GgufWeight

PACK_HINT = 128  # rows the packed layout is tuned for; good from 1 row to hundreds here
# A decode step: every layer in one native call (llama.py); beside oneDNN's bf16 weight, the panels
# serve it. 12 rows is one register tile of the AVX-512 panel GEMM (two of AVX2's), so a step of up to
# 12 reads each panel from memory once and is bound by that read (design_choices.json, "few_rows").
FEW_ROWS = 12


NATIVE_READS = (torch.float32, torch.bfloat16, torch.float16)  # what `write_panels` converts from


def rounded_for(dst: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                reads: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """w as a copy into dst takes it, so that dst gets w's values rounded to `dtype` (the weights'
    dtype, which dst may be wider than): w itself where converting it straight to dst's dtype
    rounds the same (dst in `dtype`, or w already in it) and the writer reads w's dtype (`reads`:
    any, when None), else w.to(dtype) first."""
    direct = (dst.dtype == dtype or w.dtype == dtype) and (reads is None or w.dtype in reads)
    return w if direct else w.to(dtype)


def pick_bounds(w: torch.Tensor, near: torch.Tensor) -> torch.Tensor:
    """Per row of a weight w [n, k] and its approximation `near` (the values the pick multiplies:
    bf16(w), or scale * int8), fp64: |w - near| + gamma (|w| + |near|) (Euclidean norms), gamma =
    (2k + 2) u / (1 - (2k + 2) u), u = 2^-24 (an FMA or a multiply and an add a term, and the
    scale's product). |h| times it bounds the gap between h's two products, each computed in fp32."""
    w, near = w.double(), near.double()
    n = 2 * w.shape[1] + 2
    gamma = n * 2.0 ** -24 / (1 - n * 2.0 ** -24)
    return (w - near).norm(dim=1) + gamma * (w.norm(dim=1) + near.norm(dim=1))


class Linear(nn.Module):
    """y = x W^T + b, as nn.Linear (same parameter names, so checkpoints load as they are).
    `pack()`, once the weights are final, prepares the fast path for the device and dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None  # [ceil(n / width), k, width] for linear_panels (see above)
        self.panels_n = 0  # the packed weight's rows (a tensor-parallel shard's n, not out_features)
        self.dot = False  # bf16 x of more than FEW_ROWS rows over bf16 panels in bf16 dot products
        # an exact greedy pick from half the bytes (fp32 panels' bf16 copy and each row's error bound;
        # ext/cpu/greedy_pick.cpp's Note [An exact greedy pick from half the LM head's bytes]): `pack_pick`
        self.pick: torch.Tensor | None = None  # bf16 panels beside fp32 ones; int8 beside bf16 ones
        self.pick_bounds: torch.Tensor | None = None  # [n] fp64
        self.pick_scales: torch.Tensor | None = None  # [n] fp32: each row's int8 scale
        self.gguf = None  # a GgufWeight or GgufStack (engine/models/gguf_weights.py): the weight in a GGUF file's blocks
        self.tied = False

    def pack(self) -> str:
        """Reorder the weight for the device's fastest GEMM if one applies; returns the path
        taken (a refusal by oneDNN falls back to F.linear, with its reason)."""
        if self.gguf is not None:
            where = "a super-block at a time" if self.gguf.type_name.endswith("_K") else "in registers"
            how = "int8 activations, integer sums" if self.gguf.quantizes_x else "float32 arithmetic"
            return f"GGUF {self.gguf.type_name} blocks, unpacked {where} ({how})"
        w = self.weight
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return "torch F.linear"
        if not torch.backends.mkldnn.is_available():
            return "torch F.linear (PyTorch without oneDNN)"
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT)
        except RuntimeError as exc:  # e.g. bf16 on a CPU without native bf16: never a crash
            return f"torch F.linear (oneDNN refused: {str(exc).splitlines()[0]})"
        self._drop_plain()
        return f"oneDNN packed {str(w.dtype).removeprefix('torch.')}"

    def panels_shape(self) -> tuple[int, int, int]:
        """[ceil(n / width), k, width]: the panels `pack_panels` writes (n, k the weight's shape: a
        tensor-parallel shard's, not in_features x out_features)."""
        n, k = self.weight.shape
        width = torch.ops.vkv.panel_width()
        return -(-n // width), k, width

    def pack_panels(self, dtype: torch.dtype, drop: bool = True, into: torch.Tensor | None = None,
                    dot: bool = False) -> str:
        """Pack the weight, in dtype, into the column panels of vkv's GEMM (the native kernels
        must be built; fp32 arithmetic): into `into` where given (panels_shape, dtype: a slot on huge
        pages), in one native pass (`write_panels`), the last panel's rows past n zero. The plain
        weight is dropped as `pack` drops it, unless `pack` comes next (drop=False: panels for
        decode beside oneDNN's bf16 weight). `dot` (bf16 panels, ext.bf16_dot_gemm()): bf16 steps of
        more than FEW_ROWS rows run over them in bf16 dot products."""
        if self.gguf is not None:
            return self.pack()
        w = self.weight.detach()
        n = w.shape[0]
        panels = torch.empty(self.panels_shape(), dtype=dtype) if into is None else into
        assert tuple(panels.shape) == self.panels_shape() and panels.dtype == dtype, "panels of the weight's shape"
        if panels.shape[0] * panels.shape[2] > n:
            panels[-1, :, n - (panels.shape[0] - 1) * panels.shape[2]:].zero_()
        torch.ops.vkv.write_panels(panels, rounded_for(panels, w, dtype, NATIVE_READS).contiguous(), 0)
        self.panels, self.panels_n, self.dot = panels, n, dot and dtype == torch.bfloat16
        if drop:
            self._drop_plain()
        if self.dot:
            return (f"vkv panel GEMM (bfloat16 weights; steps of more than {FEW_ROWS} rows in AVX512-BF16 dot "
                    "products, fewer in float32 arithmetic)")
        return f"vkv panel GEMM ({str(dtype).removeprefix('torch.')} weights, float32 arithmetic)"

    def pack_pick(self) -> None:
        """Beside an LM head's panels, a copy of half their bytes and each row's bound (`pick_bounds`):
        fp32 panels get a bf16 copy; bf16 panels an int8 one, a row's scale its largest |weight| / 127."""
        assert self.panels is not None and self.panels.dtype in (torch.float32, torch.bfloat16), "panels first"
        int8 = self.panels.dtype == torch.bfloat16
        self.pick = torch.zeros_like(self.panels, dtype=torch.int8 if int8 else torch.bfloat16)
        self.pick_bounds = torch.empty(self.panels_n, dtype=torch.float64)
        self.pick_scales = torch.empty(self.panels_n) if int8 else None
        self._repick(0, self.panels.shape[0])

    def _repick(self, first: int, last: int) -> None:
        """The pick's panels [first, last), and their rows' scales and bounds, from the panels."""
        width, k = self.panels.shape[2], self.panels.shape[1]
        start, end = first * width, min(last * width, self.panels_n)
        w = self.panels[first:last].transpose(1, 2).reshape(-1, k)[:end - start].float()
        if self.pick_scales is None:
            self.pick[first:last].copy_(self.panels[first:last])  # (rounded to nearest even)
            near = w.bfloat16()
        else:
            scale = w.abs().amax(1) / 127
            q = torch.where(scale[:, None] > 0, w / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None], 0)
            q = q.round().clamp(-127, 127).to(torch.int8)
            padded = torch.zeros((last - first) * width, w.shape[1], dtype=torch.int8)
            padded[:end - start] = q
            self.pick[first:last].copy_(padded.view(last - first, width, -1).transpose(1, 2))
            self.pick_scales[start:end] = scale
            near = scale.double()[:, None] * q.double()
        self.pick_bounds[start:end] = pick_bounds(w, near)
    def _drop_plain(self) -> None:
        """Once packed, only the packed copy stays (a tied embedding's weight is not ours to drop)."""
        if not self.tied:
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    @torch.no_grad()
    def assign(self, w: torch.Tensor, start: int = 0, dtype: torch.dtype | None = None) -> None:
        """New values for rows [start, start + len(w)) of the weight ([out, in], any float dtype),
        rounded to `dtype` (the model's weights dtype; default the weight's own) and written into
        every copy this projection keeps, in place and in one pass each: the plain weight (if
        kept and its own: a tied one is the embedding's to write), the panels (rounded and
        transposed in one native pass: `write_panels`), oneDNN's packed weight (that one whole:
        start 0 and every row). No tensor that anything else holds is replaced, so the one-call
        decode path stays valid (engine/models/weights.py); oneDNN's packed weight, held by this
        Linear alone, is made anew (one pack, no copy into the old one; after sleep level 2 there
        is no old one: engine/models/weight_pages.py)."""
        if self.gguf is not None:
            raise ValueError("a weight held in GGUF blocks is not updated in place (serve the file with "
                             "quantization='dequantize' to update its weights)")
        dtype = dtype or self.weight.dtype
        end = start + w.shape[0]
        if self.packed is not None and w.dtype != dtype:  # rounded once for both packings (the
            w = w.to(dtype)  # panels round as this does: to nearest even, NaN stays NaN)
        if self.weight.numel() and not self.tied:
            self.weight.data[start:end].copy_(rounded_for(self.weight, w, dtype))
        if self.panels is not None:  # row r of the weight is column r % width of panel r // width
            torch.ops.vkv.write_panels(self.panels, rounded_for(self.panels, w, dtype, NATIVE_READS).contiguous(), start)
        if self.pick is not None:  # the panels the rows touch, and their rows' scales and bounds
            width = self.panels.shape[2]
            self._repick(start // width, -(-end // width))
        if self.packed is not None:
            if (start, end) != (0, self.out_features):
                raise ValueError("oneDNN's packed weight is written whole")
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype).to(self.packed.dtype), PACK_HINT)

    def tie(self, weight: nn.Parameter) -> None:
        """Share `weight` (an embedding's) instead of owning one; packing keeps it."""
        self.weight, self.tied = weight, True

    def step_weight(self) -> tuple[torch.Tensor, int]:
        """The weight as the native `decode_layers` takes it, and its rows: the panels, or GGUF
        blocks (GgufWeight.step_view; a GgufStack's first part, its second the step_tail)."""
        if self.gguf is not None:
            first = self.gguf.parts[0] if isinstance(self.gguf, GgufStack) else self.gguf
            return first.step_view(), first.n
        return self.panels, self.panels_n

    def step_tail(self) -> torch.Tensor | None:
        """The rows after step_weight's where the weight is a GgufStack of two parts (decode_layers'
        qkv_tails), else None."""
        return self.gguf.parts[1].step_view() if isinstance(self.gguf, GgufStack) else None

    def hold_gguf(self, weight: GgufWeight | GgufStack) -> None:
        """Keep the weight in a GGUF file's blocks (a GgufWeight of [out, in]); no plain copy."""
        if (weight.n, weight.k) != (self.out_features, self.in_features):
            raise ValueError(f"a {weight.n} x {weight.k} GGUF weight for a {self.out_features} x "
                             f"{self.in_features} projection")
        self.gguf = weight
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gguf is not None:
            rows = x.reshape(-1, self.in_features).float().contiguous()
            bias = None if self.bias is None else self.bias.float()
            parts = self.gguf.parts if isinstance(self.gguf, GgufStack) else [self.gguf]
            outs, start = [], 0
            for part in parts:
                out = rows.new_empty(rows.shape[0], part.n)
                part_bias = None if bias is None else bias[start:start + part.n]
                torch.ops.vkv.linear_gguf(rows, part.rows, part.type, part_bias, out, part.quantizes_x)
                outs.append(out)
                start += part.n
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            return out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.panels is not None and (self.packed is None or x.numel() <= FEW_ROWS * x.shape[-1]):
            rows = x.reshape(-1, self.panels.shape[1])
            dot = self.dot and x.dtype == torch.bfloat16 and rows.shape[0] > FEW_ROWS  # (bf16 in, bf16 out)
            rows = (rows if dot else rows.float()).contiguous()  # (else fp32 arithmetic)
            out = rows.new_empty(rows.shape[0], self.panels_n)
            torch.ops.vkv.linear_panels(rows, self.panels, None if self.bias is None else self.bias.float(), out)
            return out.view(*x.shape[:-1], self.panels_n).to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
