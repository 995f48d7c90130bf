"""Known model shapes for `random:<preset>` models: real sizes, random weights, for benchmarks."""
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict] = {
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, eos_token_id=151645),
    # Two small shapes of our own (no real checkpoint has them), for several models on one CPU:
    "llama-small": dict(model_type="llama", vocab_size=49152, hidden_size=512, intermediate_size=1536,
                        num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4,
                        rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen3-small": dict(model_type="qwen3", vocab_size=49152, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                        rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # SmolLM2-135M's KV geometry (30 layers, 9 query heads, 3 KV heads of 64: the same pages,
    # budgets and tensor-parallel splits) on a model 64 wide: page accounting at a tenth of the cost.
    "smollm2-kv": dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=192,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "tiny": dict(model_type="llama", vocab_size=49152, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}
