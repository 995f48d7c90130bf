"""vkv's serving engine: Llama-family models over virtual KV memory (see ../vmm)."""
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
