from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_config, load_model, weights_fingerprint
from engine.models.tokenizer import load_tokenizer

__all__ = ['ModelConfig', 'LlamaForCausalLM', 'load_config', 'load_model', 'load_tokenizer', 'weights_fingerprint']
