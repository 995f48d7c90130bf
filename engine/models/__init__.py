from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_config, load_model, load_tokenizer, weights_fingerprint

__all__ = ['ModelConfig', 'LlamaForCausalLM', 'load_config', 'load_model', 'load_tokenizer', 'weights_fingerprint']
