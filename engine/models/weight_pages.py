"""The model's weights in physical pages that can be given back: vLLM's sleep level 2.

Note [Weights that sleep]
-------------------------
Rationale. An RL loop alternates sampling with training on one machine: while the trainer runs,
the inference engine should hold no memory at all, and when sampling resumes it should take
new weights without being rebuilt. vLLM's `sleep(level=2)` drops weights and KV and rebuilds
tensors at wake-up; SGLang's memory saver keeps the same virtual addresses so nothing above is
rebuilt. vkv's KV cache already sleeps that way (level 1, vmm's `release_memory`); this puts the
weights on the same footing.

Approach. With sleep mode on (`EngineConfig.enable_sleep_mode`), once the model is prepared
every tensor an update writes (each parameter, and the GEMM panels the kernels read) is moved
into one `vmm.Reservation` over a page pool of its own (CUDA: `cuMemCreate`; host: private
anonymous pages advised onto 2 MiB pages, `vmm.PrivateHostBackend`: the weights are mapped once
and never shared, and shared memory gets no huge pages where `shmem_enabled` is `never`). Each
tensor keeps its Python object: its storage is `set_` to its slice of the reservation, so
whoever holds it (a tied lm_head, the one-call decode path's per-layer lists) holds valid
memory. `release()` unmaps every page and gives the pool's pages back: the process's memory
really drops. `restore()` maps pages at the same addresses: every tensor is valid again, its
values zero (host: faulted in by the update that writes them) or undefined (CUDA) until new
weights are written (`update_weights_from_*`, `reload_weights`), which the engine asks for
before it generates again.

Implementation. Tensors are grouped by storage (a tied weight and its alias move once), each
storage at a 64-byte-aligned offset. Who writes what: `WeightPages` alone maps, unmaps and
moves; the engine calls `release`/`restore` from `sleep(2)`/`wake_up(["weights"])` and
`filled()` after a complete update. On a failure while moving nothing is lost: a tensor's
storage is switched only after its bytes are copied, and a half-made pool is released.

Limitations. oneDNN's packed weights (bf16 arithmetic on a CPU with AMX; no native kernels)
are opaque tensors that cannot live in a reservation: `release()` drops them (and trims the
C heap so their memory leaves the process) and the whole update after `restore()` makes new ones,
held only by their `Linear`. Sleep mode is off by default: moving the weights costs start time. Where the kernel
refuses huge pages the weights sit on 4 KiB pages (slower decode and wake-up: the design
choices' "weight_pages" and "wake_at_copy_floor" in benchmarks/results/cpu/design_choices.json).
Tensor-parallel ranks are other processes: level 2 is refused there.
"""
from __future__ import annotations

import math

import torch

import vmm
from engine.models.huge_pages import trim_heap
from engine.models.linear import Linear

ALIGN = 64  # bytes: a cache line, and every dtype's item size divides it


class WeightPages:
    """The model's weight tensors, moved into one reservation whose pages can be given back."""

    def __init__(self, model: torch.nn.Module, backend: vmm.Backend):
        """backend: the weights' own (vmm.make_backend: 2 MiB memfd pages on the host, the
        driver's granularity on a GPU)."""
        groups = _storages(model)
        elsewhere = {str(storage.device) for storage, _ in groups} - {str(backend.device)}
        if elsewhere:  # a tensor's storage cannot move to another device in place
            raise ValueError(f"the weights are on {sorted(elsewhere)} and the weight pages on {backend.device}: "
                             "load the model on the pages' device")
        offsets, end = [], 0
        for storage, _ in groups:
            offsets.append(end)
            end = _aligned(end + storage.nbytes())
        self.model, self.nbytes, self.state = model, max(end, 1), "loaded"
        self.pool = vmm.PagePool(backend, math.ceil(self.nbytes / backend.page_size))
        try:
            self.range = vmm.Reservation(self.pool, self.nbytes)
            self._map()
            whole = self.range.view(torch.uint8, (self.range.nbytes,))
            for (storage, tensors), offset in zip(groups, offsets):
                whole[offset:offset + storage.nbytes()].copy_(_bytes(storage))
                for t in tensors:
                    _point(t, whole.untyped_storage(), offset)
        except BaseException:
            self.pool.close()  # (no tensor points into it before its bytes are there)
            raise

    @property
    def asleep(self) -> bool:
        return self.state == "released"

    @property
    def empty(self) -> bool:
        """Woken without weights: the pages are mapped but hold nothing yet."""
        return self.state == "empty"

    def release(self) -> None:
        """Give every page back; the tensors keep their addresses (touching them now faults)."""
        if self.state == "released":
            return
        _drop_packed(self.model)
        self.pool.backend.synchronize()
        self.range.unmap(0, self.range.num_pages)
        self.pool.release_memory()
        trim_heap()
        self.state = "released"

    def restore(self) -> None:
        """Fresh pages at the same addresses (zero on the host): new weights must be written."""
        if self.state != "released":
            return
        self.pool.restore_memory()
        try:
            self._map()
        except BaseException:
            self.pool.release_memory()
            raise
        self.state = "empty"

    def _map(self) -> None:
        """Every page, mapped: the copy of the weights that follows faults them in (faulting
        them in first costs more: design_choices.json, "wake_at_copy_floor")."""
        self.range.map_new(0, self.range.num_pages)

    def filled(self) -> None:
        """Every weight was written since `restore` (the engine checked the update was whole)."""
        self.state = "loaded"

    def resident_bytes(self) -> int:
        return 0 if self.asleep else self.range.nbytes

    def close(self) -> None:
        self.range.release()
        self.pool.close()


def _storages(model: torch.nn.Module) -> list[tuple[torch.UntypedStorage, list[torch.Tensor]]]:
    """Every tensor an update writes, grouped by the storage it lives in (oneDNN's opaque packed
    weights excepted: see the note's limitations)."""
    groups: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    for module in model.modules():
        tensors = list(module._parameters.values())
        if isinstance(module, Linear):
            tensors += [module.panels, module.pick, module.pick_bounds, module.pick_scales]
        for t in tensors:
            if t is None or id(t) in seen or t.is_mkldnn or t.untyped_storage().nbytes() == 0:
                continue
            seen.add(id(t))
            storage = t.untyped_storage()
            groups.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    return list(groups.values())


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@torch.no_grad()
def _point(t: torch.Tensor, storage: torch.UntypedStorage, offset: int) -> None:
    """t's storage becomes storage, its bytes starting at `offset` (same shape, strides, view offset)."""
    itemsize = t.element_size()
    t.set_(storage, offset // itemsize + t.storage_offset(), t.shape, t.stride())


def _drop_packed(model: torch.nn.Module) -> None:
    """oneDNN's packed weights, dropped at release: an empty placeholder of their dtype (`packed is
    None` means "never packed") until the whole update that follows restore makes them anew
    (Linear.assign); making zeros at restore only to overwrite them cost a pack of every projection."""
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None:
            module.packed = torch.empty(0, dtype=module.packed.dtype)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


