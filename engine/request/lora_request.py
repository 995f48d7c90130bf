"""What a request names to run with a LoRA adapter (vLLM's `LoRARequest`, vllm/lora/request.py).
Loading and applying adapters is engine/worker/lora.py's."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's names). The name identifies it to the registry;
    the same name with another path loads that path instead."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest: lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1 "
                             f"(0 means the base model), got {self.lora_int_id!r}")
