"""New weights in place: a trainer's weights into the serving model between rounds of an RL loop.

Note [Weights in place]
-----------------------
Rationale. Reinforcement-learning post-training alternates sampling (the engine) and training
(a trainer): after every optimizer step the engine must serve the new weights. A fresh engine
pays a start each round (load, pack, warm up) and rebuilds everything that holds a weight's
address (the one-call decode path keeps each layer's tensors).

Approach. `check(model, named_tensors)` reads every tensor first: its name as the model's
Hugging Face checkpoint has it, its full (unsharded) shape from the config, a floating-point
dtype, finite values; anything else is refused by name and nothing changes. Its answer
(`Checked`) is taken back as it is (`checked`): the server reads a checkpoint and checks it off
the engine's thread, and the engine's thread does not read it again. `apply` then writes each value
into the model's own tensors, in place: q/k/v into their rows of the fused qkv projection,
gate/up into gate_up, and every copy a projection keeps for its kernels (the plain weight if
kept, the GEMM panels, oneDNN's packed weight; engine/models/linear.py `Linear.assign`)
made again from it and copied over the old, so every address stays. Values are rounded as a
fresh load rounds them (to the model's dtype, then widened to its compute dtype), so the
engine computes what a fresh engine on the same weights computes; each copy rounds on its way in
(`rounded_for`), the panels in the same native pass that transposes them (`write_panels`), so no
rounded copy of the update is made first.

Limitations. A fused projection is written whole: a layer's q, k and v come together, as do
gate and up (a packed projection keeps no plain weight to patch a part into). Tensor-parallel
shards are not wired (ranks 1..N-1 live in other processes).
"""
from __future__ import annotations

import secrets

import torch

from engine.models.config import ModelConfig
from engine.models.linear import Linear, rounded_for

FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
         "self_attn.v_proj": ("self_attn.qkv_proj", 2), "mlp.gate_proj": ("mlp.gate_up_proj", 0),
         "mlp.up_proj": ("mlp.gate_up_proj", 1)}
PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}


def split(name: str) -> tuple[str, str, str, str]:
    """"model.layers.3.self_attn.q_proj.weight" -> ("model", "3", "self_attn.q_proj", "weight");
    a name outside the layers has an empty layer and module."""
    pre, _, rest = name.partition(".layers.")
    layer, _, local = rest.partition(".")
    module, _, kind = local.rpartition(".")
    return pre, layer, module, kind


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's Hugging Face checkpoint, by name, with its full shape."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        pre = f"model.layers.{n}."
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
        if cfg.attention_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if cfg.qk_norm:
            layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        shapes |= {pre + name: shape for name, shape in layer.items()}
    return shapes


class Checked(dict):
    """What `check` returns: {name: tensor}, checked against `model`; `whole` when it brings every
    weight. An update handed back as it is (read off the engine's thread, then applied on it) is
    not read twice (`checked`)."""

    def __init__(self, update: dict, model, whole: bool):
        super().__init__(update)
        self.model, self.whole = model, whole


def checked(model, named_tensors, whole: bool = False) -> dict[str, torch.Tensor]:
    """`check`, unless named_tensors is its own answer for this model (and whole, where asked)."""
    if isinstance(named_tensors, Checked) and named_tensors.model is model and (named_tensors.whole or not whole):
        return named_tensors
    return check(model, named_tensors, whole)


def refuse_updates_if_unwired(model) -> None:
    """ValueError if no update can be written into this model (before anything is read for one)."""
    if model.sharded:
        raise ValueError("updating the weights of a tensor-parallel engine is not wired (its other ranks "
                         "are other processes)")
    if model.gguf_blocks:
        raise ValueError("the weights are held in a GGUF's blocks, which take no update: serve the file with "
                         "quantization='dequantize' (--quantization dequantize) to update its weights")


def check(model, named_tensors, whole: bool = False) -> Checked:
    """The update as {name: tensor}, every name, shape and dtype checked; ValueError naming the
    first that does not fit (nothing is changed). whole: every weight must be there (weights
    that woke up empty after sleep level 2)."""
    refuse_updates_if_unwired(model)
    shapes = checkpoint_shapes(model.config)
    update: dict[str, torch.Tensor] = {}
    tied: list[torch.Tensor] = []
    for name, tensor in (named_tensors.items() if isinstance(named_tensors, dict) else named_tensors):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            tied.append(tensor)  # a trainer's state_dict lists the tied tensor twice: checked below
            continue
        if name not in shapes:
            raise ValueError(f"{name}: not a weight of this {model.config.model_type} model's checkpoint")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {shapes[name]}")
        if not tensor.is_floating_point():
            raise ValueError(f"{name}: dtype {tensor.dtype}, expected a floating-point tensor")
        if not finite(tensor):
            raise ValueError(f"{name}: not finite (NaN or infinity): a diverged trainer's weights?")
        if name in update:
            raise ValueError(f"{name}: given twice")
        update[name] = tensor
    for tensor in tied:  # the same tensor as the embedding's, or a contradiction
        embedding = update.get("model.embed_tokens.weight")
        if embedding is None or not (tensor.data_ptr() == embedding.data_ptr() or torch.equal(tensor, embedding)):
            raise ValueError("lm_head.weight: this model ties it to model.embed_tokens.weight; update that "
                             "(lm_head.weight is taken only equal to it)")
    absent = [name for name in shapes if name not in update]
    if absent and whole:
        raise ValueError(f"the weights are empty after sleep level 2, so an update must bring every weight: "
                         f"{len(absent)} missing, e.g. {', '.join(absent[:3])}")
    for name in update:  # fused projections come whole
        pre, layer, module, kind = split(name)
        if module in FUSED:
            fused = FUSED[module][0]
            siblings = [f"{pre}.layers.{layer}.{m}.{kind}" for m, (f, _) in FUSED.items() if f == fused]
            missing = [s for s in siblings if s not in update]
            if missing:
                raise ValueError(f"{name}: given without {', '.join(missing)} (a fused projection is updated whole)")
    return Checked(update, model, whole=not absent)


def finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in `tensor`. A NaN or infinity makes the sum NaN or infinite, so a finite
    sum settles it in one read (isfinite().all() writes a mask as large as the tensor: 20x slower
    here); only a sum that overflows from finite values is looked at element by element."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


@torch.no_grad()
def apply(model, update: dict[str, torch.Tensor]) -> None:
    """Write a checked update into the model in place (see the note above)."""
    device, dtype = model_device(model), model.weights_dtype
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in update.items():
        pre, layer, module, kind = split(name)
        value = value.detach().to(device)  # (rounded to dtype by whatever writes it: `rounded_for`)
        if layer and module in FUSED:
            target, index = FUSED[module]
            fused.setdefault(f"{pre}.layers.{layer}.{target}.{kind}", {})[index] = value
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, Linear) and kind == "weight":
            owner.assign(value, dtype=dtype)
        else:
            param = getattr(owner, name.rpartition(".")[2])
            param.data.copy_(rounded_for(param, value, dtype))
        if name == "model.embed_tokens.weight" and model.lm_head.tied:  # its packed copies too
            model.lm_head.assign(value, dtype=dtype)
    for name, parts in fused.items():  # each part into its rows (oneDNN's packed weight: whole)
        owner, kind = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        ordered = [parts[i] for i in range(len(parts))]
        if kind == "bias":
            owner.bias.data.copy_(rounded_for(owner.bias, torch.cat(ordered), dtype))
        elif owner.packed is not None:
            owner.assign(torch.cat(ordered), dtype=dtype)
        else:
            start = 0
            for part in ordered:
                owner.assign(part, start, dtype)
                start += part.shape[0]
    if model.decode:  # its fp32 copies of norms and biases (bf16 arithmetic) follow
        model.decode = [layer.decode_weights() for layer in model.model.layers]
    model.weights_version += 1
    model.fingerprint = secrets.token_bytes(32)  # no longer the bytes it was loaded from


def model_device(model) -> torch.device:
    return model.model.norm.weight.device
