"""Shared by the engine tests: the bundled model, Hugging Face references, prompts."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from pathlib import Path

import torch

from engine.worker.parallel import free_port

TESTS = Path(__file__).resolve().parent  # support modules (helpers, lossy, cuda_emulator, ...) live here
ROOT = TESTS.parent  # the repository

# SmolLM2-135M's KV geometry (its pages, budgets and head splits) on a narrow random model
# (engine/models/presets.py): for tests of page accounting, which do not need trained weights, at
# a tenth of the compute. Tests against transformers keep the bundled SmolLM2.
NARROW = "random:smollm2-kv"

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    "def fibonacci(n):",
    "In 1969, the first humans",
    "Photosynthesis is the process by which plants convert light into chemical energy. "
    "The main stages of photosynthesis are",
    "A list of prime numbers: 2, 3, 5,",
]


def child_env(*paths: str, **extra: str) -> dict[str, str]:
    """The environment for a child process of a test: this repository (and `paths`) in front of
    whatever PYTHONPATH already holds (packages carried to a machine outside site-packages)."""
    front = [str(Path(__file__).resolve().parents[1]), *paths, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, front)), **extra}


@functools.cache
def bundled_dir():
    from engine.models.loader import checkpoint_dir
    return checkpoint_dir(None)


@functools.cache
def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_trainer(path):
    """hf_model whose parameters are its own, for a test that trains it: transformers hands a
    later from_pretrained of the same file in this process the same parameters (measured: after
    one SGD step on a model, a fresh from_pretrained returned all 272 tensors stepped, at the
    trainer's addresses, even with each parameter's data cloned first), so training in place
    would change every later reference model of the pytest worker. A deep copy owns its own."""
    import copy
    return copy.deepcopy(hf_model(path))


def hf_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generation of one prompt: the reference."""
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def make_batch(seqs, table, block_size, device="cpu"):
    """A StepBatch for [(q_len, ctx_len)] per sequence, with its block-table rows."""
    from engine.kv.batch import StepBatch

    starts, row = [], 0
    for q_len, _ in seqs:
        starts.append(row)
        row += q_len
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    width = max(map(len, table))
    return StepBatch([None] * len(seqs), starts, [q for q, _ in seqs], [c for _, c in seqs],
                     torch.tensor([p for q, c in seqs for p in range(c - q, c)], device=device),
                     i32([i for i, (q, _) in enumerate(seqs) for _ in range(q)]), i32(starts),
                     i32([q for q, _ in seqs]), i32([c for _, c in seqs]),
                     i32([0] + [s + q for s, (q, _) in zip(starts, seqs)]),
                     i32([t + [0] * (width - len(t)) for t in table]), block_size)


def drive(llm, requests: list[dict], add) -> dict:
    """Random traffic: request i (a dict with an "arrive" step and an "abort" delay or None) is
    added by add(engine, f"r{i}", request) at its step, and aborted that many steps later if it
    has not finished; steps until nothing is left (a stall fails); the finished outputs by id."""
    engine, done, step, last = llm.engine, {}, 0, max(r["arrive"] for r in requests)
    while step < 2000 and (engine.has_unfinished() or step <= last):
        for i, r in enumerate(requests):
            if r["arrive"] == step:
                add(engine, f"r{i}", r)
            if r["abort"] is not None and r["arrive"] + r["abort"] == step and f"r{i}" not in done:
                engine.abort(f"r{i}")
        done |= {out.request_id: out for out in engine.step() if out.finished}
        step += 1
    assert not engine.has_unfinished(), f"stalled: {llm.stats()}; requests: {requests}"
    return done


def assert_pool_whole(llm) -> None:
    llm.engine.kv.audit()
    stats = llm.stats()
    assert stats.kv.pages_in_use == 0, stats
    assert stats.num_running == 0 and stats.num_waiting == 0


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_adapter(path, seed: int, r: int = 8, targets=LORA_TARGETS, alpha: int = 16, rslora: bool = False,
                 std: float = 0.1):
    """A LoRA adapter of the bundled model saved by `peft` at path, A and B both random
    (non-zero B: the adapter changes the output); returns the PeftModel (the reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(bundled_dir(), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                            init_lora_weights=False, use_rslora=rslora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    model.save_pretrained(str(path))
    return model.eval()


def random_adapter(path, cfg, rank: int, targets=LORA_TARGETS, seed: int = 0, std: float = 0.5) -> str:
    """A random LoRA adapter (A and B ~ N(0, std)) for a model of config cfg, written in PEFT's
    format at path without peft (for models that are no Hugging Face checkpoint); its path."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from engine.worker.lora import TARGETS, projection_shapes
    shapes, g, tensors = projection_shapes(cfg), torch.Generator().manual_seed(seed), {}
    for layer in range(cfg.num_layers):
        for module in targets:
            fused, part = TARGETS[module]
            fan_in, outs = shapes[fused]
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if fused in ('qkv_proj', 'o_proj') else 'mlp'}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(outs[part], rank, generator=g) * std
    path = Path(path)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(targets)}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


@contextlib.contextmanager
def serving(app, **config):
    """The app on a free loopback port, in a thread (uvicorn.Config's `config` added): yields its
    base URL. A port that another process took between the choice and the bind is given up for
    another; a server that does not start within a minute fails the test instead of hanging it."""
    import uvicorn

    for _ in range(5):
        port = free_port()
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
        thread = threading.Thread(target=srv.run, daemon=True)  # a failed bind ends the thread
        thread.start()
        deadline = time.monotonic() + 60
        while not srv.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if srv.started:
            break
        srv.should_exit = True
        thread.join(timeout=10)
    else:
        raise RuntimeError("the test server did not start on any of 5 free ports")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=10)


# -- a server in a test -----------------------------------------------------------------------
def async_engine(**config):
    """An engine behind the server's loop thread: random:tiny with 16 MiB of KV unless told."""
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.serving.loop.async_engine import AsyncEngine
    return AsyncEngine(LLMEngine(EngineConfig(**{"model": "random:tiny", "kv_cache_memory": 16 << 20, **config})))


@contextlib.contextmanager
def served(engine, name: str = "tiny", options=None, **uvicorn_config):
    """One server's app over `engine` (served as `name`) on a free loopback port: yields its base
    URL; the engine is shut down after, however the test ends."""
    from engine.serving.api.server import build_app
    from engine.serving.options import ServerOptions
    try:
        with serving(build_app(engine, name, options or ServerOptions()), **uvicorn_config) as base:
            yield base
    finally:
        engine.shutdown()


def complete(base: str, prompt=(1, 2, 3, 4, 5), *, key: str | None = None, headers: dict | None = None,
             timeout: float = 60, **body):
    """POST /v1/completions: greedy, 5 tokens, EOS ignored, unless `body` says otherwise."""
    import httpx
    sent = {"prompt": list(prompt) if not isinstance(prompt, str) else prompt, "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, **body}
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base + "/v1/completions", json=sent, headers=auth | (headers or {}), timeout=timeout)


# -- a checkpoint on disk ---------------------------------------------------------------------
def _tiny_shape() -> dict:
    from engine.models.presets import PRESETS
    return dict(PRESETS["tiny"], num_hidden_layers=3)


SHAPE = _tiny_shape()  # a Hugging Face config.json of the tiny preset's shape, three layers


def checkpoint(path, seed: int) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint of random weights (the tiny preset's shape) at path."""
    import json

    from safetensors.torch import save_file

    from engine.models.config import ModelConfig
    from engine.models.weights import checkpoint_shapes
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(ModelConfig.from_hf(SHAPE)).items():
        if len(shape) == 1:
            tensors[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            tensors[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SHAPE))
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def wait_until(predicate, seconds: float, what: str, every: float = 0.1):
    """predicate()'s first true value within `seconds` (asked every `every` s); else fail naming `what`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"not within {seconds} s: {what}")


def k_quant_blocks(kind: str, n: int, k: int, g: torch.Generator, decades: tuple[int, int] = (-4, -2)):
    """n rows of k weights as random Q4_K or Q6_K super-blocks (gguf-py quantizes neither): every
    bit pattern of the quants and packed scales, fp16 scales of a trained model's size (d in
    10 ** decades), row 3's scales zero."""
    import numpy as np
    size, scale_at = {"Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}[kind]
    blocks = torch.randint(0, 256, (n, k // 256, size), dtype=torch.uint8, generator=g)
    for at in scale_at:  # d (and Q4_K's dmin): fp16 in [1e-4, 1e-2)
        low, high = decades
        scales = (10 ** (torch.rand(n, k // 256, generator=g) * (high - low) + low)).half()
        scales[3] = 0
        blocks[:, :, at:at + 2] = scales.view(torch.uint8).view(n, k // 256, 2)
    return np.ascontiguousarray(blocks.view(n, -1).numpy())


def k_quant_model(path) -> str:
    """A two-layer Llama GGUF laid out as llama.cpp's Q4_K_M lays one out (random weights, the
    bundled model's tokenizer): Q4_K q, k, o, gate and up; layer 0's v and down Q6_K (so its fused
    qkv holds two types), layer 1's Q4_K; the tied embedding Q6_K. Hidden 256, 4 heads of 64, 2 kv
    heads, intermediate 512."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from engine.models.loader import bundled_gguf
    bundled, g = GGUFReader(bundled_gguf()), torch.Generator().manual_seed(11)
    vocab, hidden, inter = int(bundled.fields["llama.vocab_size"].contents()), 256, 512
    writer = GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 2), ("context_length", 2048), ("embedding_length", hidden),
                       ("feed_forward_length", inter), ("attention.head_count", 4), ("attention.head_count_kv", 2),
                       ("vocab_size", vocab), ("rope.dimension_count", 64)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in bundled.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        blocks = k_quant_blocks(kind, rows, cols, g, decades=(-5, -4))
        blocks[3] = k_quant_blocks(kind, 4, cols, g, decades=(-5, -4))[0]  # (no all-zero row 3)
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[kind])

    add("token_embd.weight", "Q6_K", vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for n in range(2):
        six = "Q6_K" if n == 0 else "Q4_K"
        for name, kind, rows, cols in (("attn_q", "Q4_K", hidden, hidden), ("attn_k", "Q4_K", 128, hidden),
                                       ("attn_v", six, 128, hidden), ("attn_output", "Q4_K", hidden, hidden),
                                       ("ffn_gate", "Q4_K", inter, hidden), ("ffn_up", "Q4_K", inter, hidden),
                                       ("ffn_down", six, hidden, inter)):
            add(f"blk.{n}.{name}.weight", kind, rows, cols)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{n}.{name}.weight", np.ones(hidden, np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return str(path)


def one_call_equals_layer_by_layer(model, run, in_one_region: bool, steps: int = 9):
    """run() (a generation's tokens and logprobs) with the model's decode steps in one native call
    (decode_layers), then layer by layer in Python (model.decode emptied): asserted equal to the
    bit, and returned. With in_one_region, the stage clock must count at least `steps` steps
    whose layers ran in one parallel region (one-row steps on two threads, vector builds)."""
    import ext
    if in_one_region and ext.kernel_isa()[0] != "scalar":  # (the scalar build runs them layer by layer)
        torch.ops.vkv.decode_stage_times(True)
        torch.ops.vkv.time_decode_stages(True)
        try:
            run()
        finally:
            torch.ops.vkv.time_decode_stages(False)
        times = torch.ops.vkv.decode_stage_times(True)
        assert times["steps in one region"] >= steps, times  # (each token after the prompt's)
    fused = run()
    weights, model.decode = model.decode, []
    try:
        assert run() == fused
    finally:
        model.decode = weights
    return fused
