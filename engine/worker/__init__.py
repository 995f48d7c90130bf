"""Running a step: the model runner, attention kernels, LoRA, a rank's weights and KV cache,
tensor parallelism, and mapping pages ahead of a step."""
