"""The engine: requests in, one `step()` at a time, outputs back (vLLM v1's LLMEngine). Data
goes one way:

    InputProcessor (a request checked, its sequences) -> EngineCore.step (schedule, run,
    sample, update) -> OutputProcessor (text, stop strings, outputs) -> EngineCore.finish

The core (engine/core/engine_core.py) knows sequences and tokens; the processors know requests and text.
The sequences a stop string ended go back to the core, which finishes them before the next
step. A failure while sampling or processing one request fails that request alone (finish
reason "error", the message in its output) and the step goes on for the others; a failure of
the batch as a whole propagates: the engine is then broken.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import secrets
import time

import vmm
from engine.request.beam_search import BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.kv.publisher import make_publisher
from engine.request.lora_request import LoRARequest
from engine.worker.lora import LoRARegistry
from engine.models import load_tokenizer, weights
from engine.models.loader import checkpoint_dir, read_checkpoint, read_config
from engine.core.output_processor import OutputProcessor
from engine.request.outputs import RequestOutput
from engine.worker.parallel import RecordedKV, start_ranks
from engine.core.processor import EngineRequest, InputProcessor
from engine.request.sampling_params import SamplingParams
from engine.stats import Counters, EngineStats
from engine.request.structured import Grammars

log = logging.getLogger("vkv.engine")


WAKE_TAGS = ("weights", "kv_cache")  # what wake_up maps back (vLLM's tags)


class EngineSleeping(RuntimeError):
    """A request came while the engine sleeps."""


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: tuple | None = None, pool: vmm.PoolShare | None = None):
        """loaded: (model, tokenizer) already in memory for config.model, to run another engine
        over the same weights (a fresh KV cache and scheduler) without loading them again.
        pool: this model's share of a physical pool several models draw from (engine/multi.py);
        config.kv_cache_memory is then ignored. With tensor_parallel_size N > 1, ranks 1..N-1
        run in processes of their own (engine/worker/parallel.py)."""
        self.config = c = config
        rank, self.workers = start_ranks(c, loaded[0] if loaded else None, pool)
        self.rank, self.model_config, self.max_model_len = rank, rank.model_config, rank.max_model_len
        self.model, self.attention, self.kv, self.kv_memory = rank.model, rank.attention, rank.kv, rank.memory
        self.tokenizer = loaded[1] if loaded else load_tokenizer(c.model)
        self.eos_ids = self.model_config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.kv_events = make_publisher(c.kv_events_config, c.data_parallel_rank)  # vLLM's KV events, or None
        if self.workers:  # the other ranks replay what changes the KV cache (engine/worker/parallel.py)
            self.kv = RecordedKV(self.kv)
            self.kv_memory = RecordedKV(self.kv_memory, "memory", self.kv.ops)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.core = EngineCore(c, self.kv, self.model, self.attention, self.max_model_len, self.eos_ids,
                               self.grammars, self.workers)
        self.scheduler = self.core.scheduler
        self.loras = LoRARegistry(self.model_config, c.max_lora_rank, c.max_cpu_loras or c.max_loras, c.device,
                                  c.compute_dtype) if c.enable_lora else None
        self.processor = InputProcessor(c, self.model_config, self.max_model_len, self.tokenizer, self.eos_ids,
                                        self.grammars, self.kv.capacity, self.loras)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_ids)
        self.closed = False
        self.paused = False  # pause_generation: no step runs until continue_generation
        self.counters = Counters()
        log.info("vkv: %s", "; ".join(f"{k}: {v}" for k, v in self.platform().items()))

    def platform(self) -> dict[str, str]:
        """Which paths run on this machine, and why (engine/worker/rank.py)."""
        return {**self.rank.platform(self.config), "decode": self.core.decode_path}

    # -- requests -------------------------------------------------------------------------
    def process_inputs(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams, *,
                       group: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> EngineRequest:
        """The request tokenized and checked, its LoRA adapter loaded (engine/core/processor.py);
        ValueError, with the numbers, for one the engine would refuse. Thread-safe: a server
        runs it off the engine's thread."""
        return self.processor.process(request_id, prompt, params, group, priority, lora_request)

    def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams, *,
                    group: str | None = None, priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """prompt: text, token ids or a Prompt. With BeamSearchParams the request is a beam
        search: its beams are greedy sequences that a BeamGroup steers."""
        self.add(self.process_inputs(request_id, prompt, params, group=group, priority=priority,
                                     lora_request=lora_request))

    def add_lora(self, request: LoRARequest) -> None:
        """Load (and check) an adapter now rather than with its first request, and serve it by
        name (vLLM's add_lora); ValueError by name. Thread-safe."""
        self.processor.adapter(request)  # LoRA off, or not a LoRARequest: refused by name
        self.loras.serve(request)

    def next_lora_id(self) -> int:
        """A lora_int_id no adapter of this engine has had."""
        if self.loras is None:
            raise ValueError("LoRA is not enabled: construct the engine with enable_lora=True")
        return self.loras.next_id()

    def lora_requests(self) -> dict[str, LoRARequest]:
        """The adapters served by name (added with add_lora and not removed)."""
        return self.loras.requests() if self.loras else {}

    def remove_lora(self, name: str) -> bool:
        """Drop an adapter from memory; requests running with it finish with it."""
        return self.loras.drop(name) if self.loras else False

    def list_loras(self) -> list[str]:
        return self.loras.names() if self.loras else []

    def add(self, request: EngineRequest) -> None:
        """Queue a request that process_inputs made."""
        if self.is_sleeping:
            raise EngineSleeping("the engine is sleeping: wake it up first")
        if self.model.pages is not None and self.model.pages.empty:
            raise EngineSleeping("the weights woke up empty after sleep level 2: load them first "
                                 "(update_weights_from_disk, update_weights_from_tensor or reload_weights)")
        if request.request_id in self.output_processor.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.processor.check_room(request)
        first = self.processor.sequence(request, time.monotonic())
        self.output_processor.add(request.request_id, request.prompt, first.params, first.beam)
        self.core.add(first)
        self.counters.prompt_tokens += len(first)

    def abort(self, request_id: str) -> None:
        if self.output_processor.abort(request_id):
            self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    @property
    def map_seconds(self) -> float:
        """Time spent mapping and copying KV pages so far on the step's critical path."""
        return self.core.map_seconds

    # -- sleep (vLLM's sleep mode) ---------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode. Level 1: every physical KV page goes; reservations, views and
        weights stay, so waking up rebuilds nothing above the KV cache. Level 2: the weights'
        pages go too (sleep mode only: engine/models/weight_pages.py); they come back empty at
        the same addresses, for new weights. Requests in flight are not touched: sleeping with
        any unfinished raises (finish or abort them first; the server drains them)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: choose 1 (the KV cache) or 2 (the KV cache and the weights)")
        if level not in self.sleep_levels:
            raise ValueError("sleep level 2 gives the weights' memory back: start the engine with "
                             "enable_sleep_mode=True (--enable-sleep-mode)")
        if self.has_unfinished():
            raise RuntimeError(f"cannot sleep with {len(self.output_processor.requests)} requests in flight: "
                               f"finish or abort them")
        if not self.kv_memory.asleep:
            self.kv_memory.sleep()
            self.sync_workers()
            self.publish_kv_events()
        if level == 2:
            self.model.pages.release()

    @property
    def sleep_levels(self) -> tuple[int, ...]:
        """1 always; 2 with the weights in pages (enable_sleep_mode)."""
        return (1, 2) if self.model.pages is not None else (1,)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map memory back: tags "kv_cache" and "weights" (vLLM's), default both. Weights that
        slept at level 2 come back empty: load them (update_weights_from_disk / _from_tensor,
        reload_weights) before generating."""
        tags = list(WAKE_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up tags {unknown}: choose from {list(WAKE_TAGS)}")
        if "weights" in tags and self.model.pages is not None:
            self.model.pages.restore()
        if "kv_cache" in tags:
            self.kv_memory.wake_up()
            self.sync_workers()

    def reload_weights(self) -> None:
        """Read this engine's own checkpoint into place again (after sleep level 2)."""
        self.update_weights_from_disk(self.config.model)

    # -- new weights, pause and continue (RL loops: engine/models/weights.py) ----------------
    def pause_generation(self, mode: str = "abort") -> list[str]:
        """No step runs until continue_generation (SGLang's and vLLM's pause). "abort": every
        request in flight ends now (their ids are returned); "retract": they keep their place,
        give their KV back, and are computed again (under new weights, if updated meanwhile)
        when generation goes on."""
        if mode not in ("abort", "retract"):
            raise ValueError(f"pause_generation mode {mode!r}: choose 'abort' or 'retract'")
        aborted = list(self.output_processor.requests) if mode == "abort" else []
        for request_id in aborted:
            self.abort(request_id)
        if mode == "retract":
            self.scheduler.queues.retract_all()
        self.paused = True
        return aborted

    def continue_generation(self) -> None:
        self.paused = False

    @property
    def weights_version(self) -> int:
        """Updates written into the model since it loaded: every page name chains from it."""
        return self.model.weights_version

    def update_weights_from_tensor(self, named_tensors) -> None:
        """New weights in place: {name: tensor} or (name, tensor) pairs named as the model's
        Hugging Face checkpoint names them, all checked first (ValueError by name, nothing
        changed). Every page name chains from the weights' version from now on, so no prefix
        computed under the old weights is ever served. Sequences may not hold KV: pause with
        "retract" (or "abort") first, or update between requests."""
        if self.model.pages is not None and self.model.pages.asleep:
            raise EngineSleeping("the weights sleep (level 2): wake_up(tags=['weights']) before writing new ones")
        empty = self.model.pages is not None and self.model.pages.empty
        update = weights.checked(self.model, named_tensors, whole=empty)
        if self.kv_memory.busy:
            raise RuntimeError("requests in flight hold KV computed with the current weights: "
                               "pause_generation('retract') or ('abort') first")
        weights.apply(self.model, update)
        if empty:
            self.model.pages.filled()
        # a fresh name, not one derived from the old alone: two runs (or two processes over one
        # pool) updating the same start to different weights must not find each other's KV
        renamed = hashlib.sha256(self.kv.namespace + b"vkv/weights-update" + secrets.token_bytes(32)).digest()
        self.kv_memory.forget_prefixes(renamed)
        self.publish_kv_events()
        log.info("vkv: weights updated in place (%d tensors, version %d)", len(update), self.weights_version)

    def update_weights_from_disk(self, path: str) -> None:
        """update_weights_from_tensor with every tensor of a Hugging Face checkpoint directory
        (or a .gguf file) of this model's config: a checkpoint whose config.json differs (another
        RoPE base, an untied LM head) would need another engine, and is refused by name."""
        self.update_weights_from_tensor(self.read_weights_from_disk(path))

    def read_weights_from_disk(self, path: str) -> dict:
        """A checkpoint's tensors, read and checked against this model (ValueError by name);
        changes nothing, so it may run off the engine's thread (the server reads there, and
        checks every model an update names before any of them takes it)."""
        weights.refuse_updates_if_unwired(self.model)  # (before a GGUF at path is converted for nothing)
        try:
            where = checkpoint_dir(path)
            if where is None:
                raise ValueError(f"{path!r} is a random model: it has no weights on disk")
            config = read_config(where / "config.json")
            state, _ = read_checkpoint(where)
        except FileNotFoundError:
            raise
        except (OSError, RuntimeError) as exc:  # RuntimeError: expanduser of an unknown ~user
            raise ValueError(f"{path}: cannot read a checkpoint there ({exc.strerror or exc})"
                             if isinstance(exc, OSError) else f"{path}: {exc}") from None
        except ValueError:
            raise
        except Exception as exc:  # a damaged .gguf: its reader's own error, said as ours
            raise ValueError(f"{path}: cannot read its weights ({type(exc).__name__}: {exc})") from None
        differ = [f.name for f in dataclasses.fields(config)
                  if getattr(config, f.name) != getattr(self.model_config, f.name)]
        if differ:
            raise ValueError(f"{where / 'config.json'}: {', '.join(differ)} differ from the running model's "
                             f"config: start an engine on it instead")
        if self.model_config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # (as a load drops it)
        return weights.check(self.model, state)

    def sync_workers(self) -> None:
        """Tensor parallel: the other ranks apply the KV operations made outside a step now."""
        if self.workers:
            self.workers.send(self.kv.take_ops(), None)

    def publish_kv_events(self) -> None:
        """What the KV cache and its tiers took in and let go since the last call, to the
        publisher (engine/kv/publisher.py), if any."""
        if self.kv_events:
            self.kv_events.publish(self.kv.events.take())

    @property
    def is_sleeping(self) -> bool:
        """The KV cache or the weights (level 2) are asleep."""
        return self.kv_memory.asleep or (self.model.pages is not None and self.model.pages.asleep)

    # -- the loop -------------------------------------------------------------------------
    def step(self, token_budget: int | None = None) -> list[RequestOutput | BeamSearchOutput]:
        """One forward pass over the scheduled batch; outputs of the requests it advanced.
        token_budget: at most this many tokens this step (below max_num_batched_tokens), so
        other models sharing the machine wait at most one short step (engine/multi.py)."""
        if self.paused:
            return []
        done = self.core.step(token_budget)
        self.publish_kv_events()
        if done is None:
            return []
        self.output_processor.add_prompt_scores(done.prompt_scores)
        outputs, stopped, failed = self.output_processor.process(done.seqs)
        self.core.finish(stopped, failed)
        self.counters.count_step(done.sampled.drafts, done.sampled.drafted, done.sampled.accepted,
                                 done.sampled.decode_steps, sum(len(o.new) for o in done.seqs), outputs)
        return outputs

    # -- numbers --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        kv, ahead = self.kv.stats(), self.core.map_ahead
        running, waiting = self.scheduler.queues.running, [*self.scheduler.queues.waiting, *self.scheduler.queues.swapped]
        adapters = lambda seqs: tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))
        token_bytes = sum(s.num_computed_tokens for s in running) * self.kv.layout.token_bytes
        mapped_bytes = (kv.pages_in_use + kv.pages_idle) * kv.page_size
        return EngineStats(kv=kv, attention_backend=self.attention.name, platform=self.platform(),
                           num_running=len(running), preemptions=self.scheduler.num_preemptions,
                           num_waiting=len(waiting), running_loras=adapters(running), waiting_loras=adapters(waiting),
                           max_loras=self.config.max_loras if self.loras else 0,
                           kv_utilization=token_bytes / mapped_bytes if mapped_bytes else 0.0,
                           map_ahead_seconds=ahead.seconds if ahead else 0.0,
                           map_ahead_wait_seconds=ahead.wait_seconds if ahead else 0.0,
                           **self.counters.totals())

    def close(self) -> None:
        """Give everything back (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.core.close()
        if self.workers:
            self.workers.close()
        self.kv.close()
        if self.kv_events:
            self.publish_kv_events()  # the cache let go at close: announced before the socket goes
            self.kv_events.close()
