"""The scheduler (vLLM v1's `schedule()` -> `SchedulerOutput` -> `update_from_output()`), its
admission order, the step's types, and beam search's groups."""
