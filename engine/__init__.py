"""vkv's serving engine: Llama-family models over virtual KV memory (see ../vmm)."""
from engine.request.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.llm import LLM
from engine.request.lora_request import LoRARequest
from engine.multi import MultiLLM
from engine.request.outputs import CompletionOutput, Logprob, RequestOutput
from engine.request.sampling_params import SamplingParams

__all__ = ["LLM", "MultiLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence", "LoRARequest", "Logprob"]
