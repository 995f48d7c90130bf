"""Configs per concern: each of the five (model, cache, scheduler, parallel, LoRA) checks its own
fields when made alone or inside an EngineConfig; the settings that span two are refused by
EngineConfig.check_pairs, by name; the flat names LLM(...) takes stay the same."""
import dataclasses
import pickle

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelArgs, ParallelConfig, SchedulerConfig


@pytest.mark.parametrize("concern, fields, says", [
    (ModelArgs, {"dtype": "fp64"}, "unknown dtype"),
    (ModelArgs, {"attention_backend": "magic"}, "unknown attention backend"),
    (CacheConfig, {"kv_layout": "tree"}, "unknown kv_layout"),
    (CacheConfig, {"kv_cache_memory": 0}, "kv_cache_memory must be > 0"),
    (CacheConfig, {"block_size": 0}, "block_size must be >= 1"),
    (CacheConfig, {"kv_events_config": {"enable_kv_cache_events": True, "colour": 1}}, "unknown field"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    (SchedulerConfig, {"scheduling_policy": "lifo"}, "unknown scheduling_policy"),
    (SchedulerConfig, {"num_scheduler_steps": 2, "speculative_config": {"method": "ngram"}}, "not both"),
    (ParallelConfig, {"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    (ParallelConfig, {"tensor_parallel_workers": "external"}, "needs distributed_init"),
    (LoRAConfig, {"max_loras": 2, "max_cpu_loras": 1}, "must be >= max_loras"),
])
def test_each_concern_checks_its_own_fields_alone_and_in_the_engines(concern, fields, says):
    with pytest.raises(ValueError, match=says):
        concern(**fields)
    with pytest.raises(ValueError, match=says):
        EngineConfig(**fields)


@pytest.mark.parametrize("fields, says", [
    ({"preemption_mode": "swap", "kv_layout": "paged"}, "needs a virtual kv_layout"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "need prefix caching on"),
    ({"kv_pool": "/tmp/x.sock", "kv_layout": "paged"}, "kv_pool"),
    ({"kv_events_config": {"enable_kv_cache_events": True}, "enable_prefix_caching": False}, "prefix caching on"),
    ({"enable_lora": True, "tensor_parallel_size": 2}, "enable_lora with tensor_parallel_size"),
    ({"enable_sleep_mode": True, "tensor_parallel_size": 2}, "enable_sleep_mode with tensor_parallel_size"),
])
def test_settings_across_two_concerns_are_refused_by_the_engines_config(fields, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**fields)


def test_the_flat_names_defaults_and_copies_stay_as_they_were():
    c = EngineConfig(max_num_seqs=3, kv_layout=None)
    assert [f.name for f in dataclasses.fields(c)][0] == "model"  # positional order starts as before
    assert c.kv_layout == "per_layer" and c.device.type == "cpu" and c.dtype == torch.float32  # resolved defaults
    assert isinstance(c, (ModelArgs, CacheConfig, SchedulerConfig, ParallelConfig, LoRAConfig))
    again = dataclasses.replace(c, max_num_seqs=5)  # checked again, resolved values accepted
    assert again.max_num_seqs == 5 and pickle.loads(pickle.dumps(again)) == again  # (tensor-parallel ranks)
