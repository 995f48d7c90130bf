"""Several models over one physical KV pool: `MultiLLM`, the offline API next to `LLM`.

Every model is an `LLMEngine` of its own (weights, scheduler, slots, views, prefix cache),
and every engine's KV cache draws its physical pages from one `vmm.SharedPool` through a
`vmm.PoolShare` (vmm/share.py has the note): a model with traffic takes the pages others do
not use, within its cap and the others' floors, and when short it asks them to give back
their idle and cached pages. `step()` steps each model with work once, in turn, so one
model's burst delays another's decode by at most one of its steps, never by its whole queue.

    llms = MultiLLM({"small": None, "big": "random:smollm2-135m"}, kv_cache_memory=1 << 30,
                    kv_limits={"small": (0.25, 1.0)})
    llms.generate(["Hello"], SamplingParams(max_tokens=8), model="small")
"""
from __future__ import annotations

import dataclasses
import time
from itertools import count

import vmm
from engine.config import EngineConfig
from engine.kv.build import backend_for
from engine.llm import as_prompt_list
from engine.core.llm_engine import LLMEngine
from engine.request.outputs import RequestOutput
from engine.core.processor import EngineRequest
from engine.request.sampling_params import SamplingParams
from engine.stats import EngineStats


SHARED_STEP_TOKENS = 256  # a step's tokens while other models have work (see step_budget())


def step_budget(engine: LLMEngine, engines, step_tokens: int | None) -> int | None:
    """The tokens `engine` may compute this step: step_tokens while another of the models has
    work (so one model's burst of prefills delays another's next token by one short step), else
    None (its own limit). MultiLLM.step and the server's model loops both ask this."""
    return step_tokens if any(e.has_unfinished() for e in engines if e is not engine) else None


def idle_long_enough(engine: LLMEngine, last_active: float, idle_seconds: float, now: float) -> bool:
    """Whether a model should sleep for being idle: awake, no requests, none for idle_seconds."""
    return not engine.is_sleeping and not engine.has_unfinished() and now - last_active >= idle_seconds
POOL_SETTINGS = {"kv_cache_memory", "gpu_memory_utilization", "page_size", "device", "tensor_parallel_size"}


def pages_of(limit: float | int, total: int, page_size: int) -> int:
    """A limit in pages: a float in [0, 1] is a share of the pool, an int is bytes."""
    if isinstance(limit, float):
        if not 0 <= limit <= 1:
            raise ValueError(f"a KV limit given as a share must be in [0, 1], got {limit}")
        return int(limit * total)
    if limit < 0:
        raise ValueError(f"a KV limit in bytes must be >= 0, got {limit}")
    return limit // page_size


def check_shareable(config: EngineConfig, who: str) -> None:
    """Only a virtual layout on one rank draws its pages from the shared pool (a paged cache's
    blocks and a tensor-parallel rank's pages are their own): refuse the others by name."""
    if config.kv_layout == "paged" or config.tensor_parallel_size > 1:
        raise ValueError(f"{who}: several models share one pool on a virtual kv_layout (interleaved or per_layer) "
                         f"with tensor_parallel_size 1, not kv_layout={config.kv_layout!r}, "
                         f"tensor_parallel_size={config.tensor_parallel_size}")


class MultiLLM:
    def __init__(self, models: dict[str, str | None | dict], kv_cache_memory: int | None = None,
                 kv_limits: dict[str, tuple[float | int, float | int]] | None = None, **engine_options):
        """models: name -> source (as LLM's `model`), or name -> {"model": source, and engine
        options of that model alone, e.g. "dtype": "bfloat16", "kv_layout": "interleaved"}.
        kv_limits: name -> (floor, cap), each a share of the pool (float) or bytes (int). Other
        options apply to every model."""
        self._build(models, EngineConfig(model=None, kv_cache_memory=kv_cache_memory, **engine_options), kv_limits)

    @classmethod
    def from_config(cls, models: dict[str, str | None], config: EngineConfig,
                    kv_limits: dict[str, tuple[float | int, float | int]] | None = None) -> MultiLLM:
        """The models with `config`'s settings (its model is ignored; its KV budget is the pool's)."""
        group = cls.__new__(cls)
        group._build(models, config, kv_limits)
        return group

    def _build(self, models: dict[str, str | None], config: EngineConfig, kv_limits: dict | None) -> None:
        if not models:
            raise ValueError("MultiLLM needs at least one model")
        check_shareable(config, "MultiLLM")
        for name in kv_limits or {}:
            if name not in models:
                raise ValueError(f"unknown model {name!r} in a KV limit: the models are {sorted(models)}")
        backend = backend_for(config)
        self.shared = vmm.SharedPool(vmm.PagePool(backend, config.kv_budget_bytes() // backend.page_size))
        self.engines: dict[str, LLMEngine] = {}
        self.last_active: dict[str, float] = {}
        self.shared_step_tokens = SHARED_STEP_TOKENS
        self._ids = count()
        try:
            for name in models:
                self.shared.tenant(name)
            for name, (floor, cap) in (kv_limits or {}).items():
                self.set_limits(name, floor, cap)
            for name, source in models.items():
                share = self.shared.tenants[name]
                own = dict(source) if isinstance(source, dict) else {"model": source}
                shared_only = sorted(set(own) & POOL_SETTINGS)
                if shared_only:
                    raise ValueError(f"model {name!r}: {', '.join(shared_only)} belong to the shared pool, "
                                     f"not to one model")
                own_config = dataclasses.replace(config, kv_cache_memory=None, **own)
                check_shareable(own_config, f"model {name!r}")
                try:
                    engine = LLMEngine(own_config, pool=share)
                except Exception as exc:
                    raise ValueError(f"model {name!r} ({own.get('model') or 'bundled'}) failed to load: {exc}") from exc
                self.engines[name] = engine
                self.last_active[name] = time.monotonic()
        except BaseException:
            self.close()
            raise

    # -- limits ---------------------------------------------------------------------------
    def set_limits(self, model: str, floor: float | int = 0, cap: float | int = 1.0) -> None:
        """A model's floor (pages no other model can take from it) and cap (pages it never
        exceeds), each a share of the pool (float) or bytes (int); checked against the others'."""
        total, page = self.shared.pool.num_pages, self.shared.pool.page_size
        share = self.shared.tenants.get(model)
        before = (share.floor, share.cap) if share is not None else None
        self.shared.set_limits(model, pages_of(floor, total, page), pages_of(cap, total, page))
        for name, engine in self.engines.items():  # no request in flight may be left needing more than it can get
            most, s = self.shared.tenants[name].most_pages, engine.scheduler.queues
            for seq in (*s.waiting, *s.running, *s.swapped):
                need = engine.processor.pages_needed(len(seq) - seq.num_output_tokens + (seq.params.max_tokens or 0))
                if need > most:
                    self.shared.set_limits(model, *before)
                    raise ValueError(f"model {model!r}: these limits leave model {name!r} {most} pages, and its "
                                     f"request {seq.request_id!r} in flight needs {need}")

    # -- requests -------------------------------------------------------------------------
    def limits(self) -> dict[str, dict[str, int]]:
        """Each model's floor, cap and pages held, in pages and bytes."""
        page = self.shared.pool.page_size
        return {name: {"min_pages": t.floor, "max_pages": t.cap, "used_pages": t.used, "min_bytes": t.floor * page,
                       "max_bytes": t.cap * page, "used_bytes": t.used * page}
                for name, t in self.shared.tenants.items()}

    def engine(self, model: str) -> LLMEngine:
        if model not in self.engines:
            raise KeyError(f"unknown model {model!r}: the models are {sorted(self.engines)}")
        return self.engines[model]

    def add_request(self, model: str, request_id: str, prompt, params) -> None:
        self.add(model, self.engine(model).process_inputs(request_id, prompt, params))

    def add(self, model: str, request: EngineRequest) -> None:
        """Queue a request the model's engine made (process_inputs); a sleeping model wakes."""
        engine = self.engine(model)
        if engine.is_sleeping:
            engine.wake_up()
        engine.add(request)
        self.last_active[model] = time.monotonic()

    def abort(self, model: str, request_id: str) -> None:
        self.engine(model).abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines.values())

    def step(self) -> list[tuple[str, RequestOutput]]:
        """One step of each model that has work, in turn: (model, output) pairs. While other
        models have work, a step computes at most `shared_step_tokens` tokens, so a burst of
        prefills on one model delays another's next token by one short step, not a long one."""
        outputs = []
        busy = [name for name, engine in self.engines.items() if engine.has_unfinished()]
        for name in busy:
            budget = step_budget(self.engines[name], self.engines.values(), self.shared_step_tokens)
            outputs += [(name, out) for out in self.engines[name].step(budget)]
            self.last_active[name] = time.monotonic()
        return outputs

    def generate(self, prompts, params: SamplingParams | None = None, model: str | None = None) -> list[RequestOutput]:
        """LLM.generate for one model (default: the first); the others keep stepping."""
        model = model or next(iter(self.engines))
        engine, prompts = self.engine(model), as_prompt_list(prompts)
        params = params or SamplingParams()
        requests = [engine.process_inputs(f"multi-{next(self._ids)}", p, params, group="llm") for p in prompts]
        for request in requests:
            self.add(model, request)
        ids, done = [r.request_id for r in requests], {}
        while any(i not in done for i in ids):
            done |= {out.request_id: out for name, out in self.step() if name == model and out.finished}
        return [done[i] for i in ids]

    # -- idle models sleep ------------------------------------------------------------------
    def sleep_idle(self, idle_seconds: float) -> list[str]:
        """Sleep (give every KV page back to the pool) each model without requests for
        idle_seconds; returns their names. A request wakes a model again."""
        now, slept = time.monotonic(), []
        for name, engine in self.engines.items():
            if idle_long_enough(engine, self.last_active[name], idle_seconds, now):
                engine.sleep(1)
                slept.append(name)
        return slept

    def sleep(self, model: str) -> None:
        self.engine(model).sleep(1)

    def wake_up(self, model: str) -> None:
        self.engine(model).wake_up()

    # -- numbers --------------------------------------------------------------------------
    def stats(self, model: str) -> EngineStats:
        return self.engine(model).stats()

    def audit(self) -> None:
        """Every model's pages against its own mappings, and each page one owner."""
        for engine in self.engines.values():
            engine.kv.audit()
        self.shared.audit()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
        self.shared.close()
        self.shared.pool.backend.close()

    def __enter__(self) -> MultiLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
