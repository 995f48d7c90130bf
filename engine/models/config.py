"""The shape of a Llama-family model, read from a Hugging Face config or a preset."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3: {"rope_type": "llama3", "factor": ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    model_type: str = "llama"
    sliding_window: int | None = None  # every layer attends to its last W keys (Mistral v0.1)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """ValueError naming the first field that is missing or out of range (a config.json is
        read from disk: nothing in it may stop the engine or build a model of absurd size)."""
        if not isinstance(hf, dict):
            raise ValueError("a model config must be a JSON object")
        for name, low, high in SIZES:
            value = hf.get(name)
            if value is None and name in OPTIONAL:
                continue
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"{name}: {value!r}, expected an integer in [{low}, {high}]")
        eps, theta = hf.get("rms_norm_eps", 1e-5), hf.get("rope_theta", 10000.0)
        for name, value in (("rms_norm_eps", eps), ("rope_theta", theta)):
            if type(value) not in (int, float) or not 0 < value < 1e12:
                raise ValueError(f"{name}: {value!r}, expected a positive number")
        if hf["hidden_size"] % hf["num_attention_heads"] and not hf.get("head_dim"):
            raise ValueError("hidden_size must divide by num_attention_heads (or head_dim be given)")
        if hf["num_attention_heads"] % (hf.get("num_key_value_heads") or hf["num_attention_heads"]):
            raise ValueError("num_attention_heads must divide by num_key_value_heads")
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED:
            raise ValueError(f"unsupported model_type {model_type!r}; vkv runs {sorted(SUPPORTED)}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        window = hf.get("sliding_window") if model_type == "mistral" else None
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            if hf.get("max_window_layers", 0) < hf["num_hidden_layers"] and hf.get("max_window_layers", 0) > 0:
                raise ValueError("a sliding window on only some layers (max_window_layers) is not supported")
            window = hf.get("sliding_window") if hf.get("max_window_layers", 0) == 0 else None
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3", model_type=model_type, sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
        )

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
SIZES = (("vocab_size", 1, 1 << 24), ("hidden_size", 1, 1 << 17), ("intermediate_size", 1, 1 << 20),
         ("num_hidden_layers", 1, 4096), ("num_attention_heads", 1, 4096), ("num_key_value_heads", 1, 4096),
         ("head_dim", 1, 4096), ("max_position_embeddings", 1, 1 << 24))
OPTIONAL = {"num_key_value_heads", "head_dim", "max_position_embeddings"}
