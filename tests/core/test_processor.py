"""InputProcessor alone: a request is checked once, where it enters, against the model and the
KV budget; what could never run to its end is refused with the numbers."""
import pytest
import torch

import vmm
from engine.config import EngineConfig
from engine.core.processor import InputProcessor
from engine.kv.manager import KVManager
from engine.kv.virtual import VirtualLayout
from engine.models import load_config, load_tokenizer
from engine.request.beam_search import BeamSearchParams
from engine.request.lora_request import LoRARequest
from engine.request.sampling_params import SamplingParams
from engine.request.structured import Grammars, StructuredOutputsParams


@pytest.fixture(scope="module")
def processor():
    config = EngineConfig(model="random:tiny", max_num_seqs=4)
    model = load_config(config.model)
    tokenizer = load_tokenizer(config.model)
    kv = KVManager(VirtualLayout(model, "per_layer", 4, 256, torch.float32, vmm.HostBackend(4096), 64))
    yield InputProcessor(config, model, 256, tokenizer, (tokenizer.eos_token_id,),
                         Grammars(tokenizer, model.vocab_size), kv.capacity)
    kv.close()


def test_a_request_becomes_one_checked_engine_request(processor):
    request = processor.process("r", "Hello there", SamplingParams(max_tokens=None), group="client")
    room = 256 - len(request.prompt.token_ids)
    assert request.params.max_tokens == room and request.group == "client"  # None: as many as fit
    seq = processor.sequence(request, now=0.0)
    assert seq.token_ids == request.prompt.token_ids and seq.request_id == "r"


@pytest.mark.parametrize("prompt, params, says", [
    ([1] * 250, SamplingParams(max_tokens=10), "exceeds max_model_len 256"),
    ([10 ** 6], SamplingParams(), "prompt token ids must be in"),
    ("x", SamplingParams(stop_token_ids=[10 ** 6]), "below the vocabulary size"),
    ([1] * 200, BeamSearchParams(beam_width=5, max_tokens=10), "beam_width 5 exceeds max_num_seqs 4"),
    ([1] * 200, BeamSearchParams(beam_width=4, max_tokens=50), "more than the whole KV budget"),
    ([], SamplingParams(), "has no tokens"),
])
def test_what_could_never_run_is_refused_with_the_numbers(processor, prompt, params, says):
    with pytest.raises(ValueError, match=says):
        processor.process("r", prompt, params)


def test_priority_lora_and_grammars_are_checked_where_the_request_enters(processor):
    with pytest.raises(ValueError, match="needs scheduling_policy='priority'"):
        processor.process("r", "x", SamplingParams(), priority=3)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        processor.process("r", "x", SamplingParams(), lora_request=LoRARequest("a", 1, "/nowhere"))
    with pytest.raises(ValueError, match="invalid structured output|regex"):
        processor.process("r", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert processor.process("r", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))).grammar
