"""New weights in place (engine/models/weights.py, Note [Weights in place]): after
update_weights_from_tensor / update_weights_from_disk, greedy outputs equal a fresh engine's on
the new weights, on every layout, with prefix caching and a KV tier on; no prefix computed
under the old weights is served; a mismatched update is refused by name and changes nothing;
pause_generation / continue_generation abort or retract requests in flight."""

import pytest
import torch
from helpers import assert_pool_whole, bundled_dir, checkpoint, hf_trainer

from engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = [[(i * 31 + j * 7) % 4000 + 50 for j in range(120)] for i in range(3)]
def greedy(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("layout,steps", [("per_layer", 1), ("paged", 1), ("per_layer", 8)])
def test_updated_weights_give_a_fresh_engines_outputs_and_no_stale_prefix(tmp_path, layout, steps):
    """(steps: multi-step decode, whose greedy pick reads the LM head's bf16 copy: updated too)"""
    old, new = checkpoint(tmp_path / "old", 0), checkpoint(tmp_path / "new", 1)
    opts = dict(kv_layout=layout, kv_cache_memory=16 << 20, kv_offloading_size=0.02, page_size=4096,  # 32 tokens a page
                num_scheduler_steps=steps)
    with LLM(model=str(tmp_path / "new"), **opts) as fresh:
        expected = greedy(fresh)
    with LLM(model=str(tmp_path / "old"), **opts) as llm:
        before = greedy(llm)
        assert before != expected  # the two checkpoints differ
        assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0  # cached under old
        version = llm.engine.weights_version
        llm.update_weights_from_tensor(list(new.items()))
        assert llm.engine.weights_version == version + 1
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0]  # nothing computed under the old weights
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert greedy(llm) == expected  # and hits under the new weights are right
        llm.update_weights_from_disk(str(tmp_path / "old"))
        assert greedy(llm) == before
        assert (llm.stats().multi_step_calls > 0) == (steps > 1)
        assert_pool_whole(llm)


def test_two_runs_updating_one_start_to_different_weights_never_read_each_others_kv(tmp_path):
    """Each update names its pages afresh: the second run, sharing the first's disk tier, restores
    nothing the first computed under its other weights."""
    checkpoint(tmp_path / "base", 0)
    first, second = checkpoint(tmp_path / "w1", 1), checkpoint(tmp_path / "w2", 2)
    opts = dict(kv_layout="per_layer", kv_cache_memory=16 << 20, page_size=4096,
                kv_offloading_path=str(tmp_path / "disk"))
    with LLM(model=str(tmp_path / "w2"), **opts) as fresh:
        expected = fresh.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(model=str(tmp_path / "base"), **opts) as llm:  # closing writes its cache to the disk tier
        llm.update_weights_from_tensor(list(first.items()))
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    with LLM(model=str(tmp_path / "base"), **opts) as llm:
        llm.update_weights_from_tensor(list(second.items()))
        out = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert next(t for t in llm.stats().kv.tiers if t.tier == "disk").tokens_restored == 0
        assert out.outputs[0].token_ids == expected


def test_a_mismatched_update_is_refused_by_name_and_changes_nothing(tmp_path):
    old, new = checkpoint(tmp_path / "old", 0), checkpoint(tmp_path / "new", 1)
    with LLM(model=str(tmp_path / "old"), kv_cache_memory=16 << 20) as llm:
        before = greedy(llm)
        q = "model.layers.1.self_attn.q_proj.weight"
        cases = {
            "model.layers.9.mlp.up_proj.weight: not a weight": {**new, "model.layers.9.mlp.up_proj.weight": new[q]},
            f"{q}: shape \\(64, 32\\), expected \\(64, 64\\)": {**new, q: new[q][:, :32]},
            "model.norm.weight: dtype torch.int64": {**new, "model.norm.weight": torch.ones(64, dtype=torch.long)},
            f"{q}: given without model.layers.1.self_attn.k_proj.weight": {q: new[q]},
            "lm_head.weight: this model ties it": {**new, "lm_head.weight": new["model.embed_tokens.weight"] + 1},
        }
        for message, update in cases.items():
            with pytest.raises(ValueError, match=message):
                llm.update_weights_from_tensor(update)
        assert greedy(llm) == before and llm.engine.weights_version == 0
        with pytest.raises(FileNotFoundError):
            llm.update_weights_from_disk(str(tmp_path / "nowhere"))
        (tmp_path / "old" / "model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(ValueError, match="cannot read its weights"):
            llm.update_weights_from_disk(str(tmp_path / "old"))
        assert greedy(llm) == before


def test_weights_in_gguf_blocks_refuse_an_update_before_changing_or_converting_anything(monkeypatch):
    """The default for a GGUF on the CPU: its blocks take no update; the refusal names the fix and
    comes before any tensor is written (a norm first in the update stays as it was) and before a
    GGUF named on disk is converted."""
    from engine.models import loader
    with LLM(kv_cache_memory=16 << 20) as llm:
        model = llm.engine.model
        assert model.gguf_blocks
        norm = model.model.layers[0].input_layernorm.weight
        before = norm.clone()
        update = {"model.layers.0.input_layernorm.weight": torch.full_like(before, 3.0),
                  "model.layers.0.self_attn.o_proj.weight": torch.zeros(576, 576)}
        for new in (update, {"model.embed_tokens.weight": torch.zeros(49152, 576)}):
            with pytest.raises(ValueError, match="quantization='dequantize'"):
                llm.update_weights_from_tensor(new)
        assert torch.equal(norm, before) and llm.engine.weights_version == 0
        monkeypatch.setattr(loader, "_convert", lambda *a: pytest.fail("converted"))
        monkeypatch.setattr(loader, "_convert_tensors", lambda *a: pytest.fail("converted"))
        with pytest.raises(ValueError, match="GGUF's blocks"):
            llm.engine.read_weights_from_disk(str(loader.bundled_gguf()))


def test_a_checkpoint_read_from_disk_is_checked_once(tmp_path, monkeypatch):
    """The server reads and checks a checkpoint off the engine's thread (read_weights_from_disk);
    the update then takes that answer without reading every tensor again on the engine's thread.
    An answer checked against another model is checked again."""
    from engine.models import weights
    checkpoint(tmp_path / "old", 0), checkpoint(tmp_path / "new", 1)
    calls = []
    real = weights.check
    monkeypatch.setattr(weights, "check", lambda *a, **k: calls.append(1) or real(*a, **k))
    with LLM(model=str(tmp_path / "old"), kv_cache_memory=16 << 20) as llm:
        before = greedy(llm)
        llm.update_weights_from_disk(str(tmp_path / "new"))
        assert len(calls) == 1
        update = llm.engine.read_weights_from_disk(str(tmp_path / "old"))
        assert len(calls) == 2 and update.whole
        llm.update_weights_from_tensor(weights.Checked(update, model=object(), whole=True))
        assert len(calls) == 3  # not this model's answer: read again
        assert greedy(llm) == before


def test_pause_retract_recomputes_under_the_new_weights_and_abort_ends_requests(tmp_path):
    checkpoint(tmp_path / "old", 0)
    new = checkpoint(tmp_path / "new", 1)
    with LLM(model=str(tmp_path / "old"), kv_cache_memory=16 << 20) as llm:
        engine = llm.engine
        engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=12))
        early = []
        while len(early) < 4:  # a few tokens under the old weights
            for out in engine.step():
                early = out.outputs[0].token_ids
        engine.pause_generation("retract")
        assert engine.step() == [] and engine.scheduler.queues.running == []  # retracted: nothing runs, nothing held
        engine.update_weights_from_tensor(new)
        engine.continue_generation()
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                final = out
        tokens = final.outputs[0].token_ids
        assert tokens[:len(early)] == early and len(tokens) == 12
        # the rest is what the new weights continue from the prompt and the early tokens
        with LLM(model=str(tmp_path / "new"), kv_cache_memory=16 << 20) as fresh:
            rest = fresh.generate([PROMPTS[0] + early], SamplingParams(temperature=0, max_tokens=12 - len(early)),
                                  use_tqdm=False)[0].outputs[0].token_ids
        assert tokens[len(early):] == rest

        engine.add_request("a", PROMPTS[1], SamplingParams(temperature=0, max_tokens=50))
        engine.step()
        engine.pause_generation("abort")
        assert not engine.has_unfinished()
        with pytest.raises(ValueError, match="mode"):
            engine.pause_generation("sideways")
        engine.continue_generation()
        assert_pool_whole(llm)


def test_over_http_behind_the_key_and_the_flag(tmp_path):
    import httpx
    from helpers import serving

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.serving.loop.async_engine import AsyncEngine
    from engine.serving.options import ServerOptions
    from engine.serving.api.server import build_app

    checkpoint(tmp_path / "old", 0)
    checkpoint(tmp_path / "new", 1)
    with LLM(model=str(tmp_path / "new"), kv_cache_memory=16 << 20) as fresh:
        expected = fresh.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].text
    key = {"Authorization": "Bearer sk-rl"}
    for enabled in (False, True):
        engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tmp_path / "old"), kv_cache_memory=16 << 20)))
        app = build_app(engine, "m", ServerOptions(api_key="sk-rl", enable_weight_updates=enabled))
        with serving(app) as base:
            post = lambda path, **kw: httpx.post(base + path, headers=key, timeout=60, **kw)
            if not enabled:
                r = post("/update_weights_from_disk", json={"model_path": str(tmp_path / "new")})
                assert r.status_code == 403 and "--enable-weight-updates" in r.json()["error"]["message"]
                assert post("/pause_generation", json={"mode": "abort"}).status_code == 403
            else:
                assert httpx.post(base + "/pause_generation", json={}, timeout=60).status_code == 401
                assert post("/pause_generation", json={"mode": "sideways"}).status_code == 400
                assert post("/pause_generation", json={"mode": "retract"}).json() == {"paused": True, "mode": "retract"}
                bad = post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")})
                assert bad.status_code == 400 and "nowhere" in bad.json()["error"]["message"]
                r = post("/update_weights_from_disk", json={"model_path": str(tmp_path / "new")})
                assert r.status_code == 200 and r.json()["weights_version"] == [1], r.text
                assert post("/continue_generation").json() == {"paused": False}
                r = post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
                assert r.json()["choices"][0]["text"] == expected
        engine.shutdown()


def test_sampled_tokens_logprobs_agree_with_a_transformers_trainer_before_and_after_an_update(own_weights):
    """An RL loop's invariant: the engine's logprob of each token it sampled equals the
    trainer's (transformers, fp32, the same weights) within 1e-3, before and after the trainer's
    weights are pushed with update_weights_from_tensor (its state_dict as it is, the tied
    lm_head.weight included)."""
    trainer = hf_trainer(bundled_dir())
    prompt = trainer.config.bos_token_id, 504, 3458, 282, 4649, 314  # a few tokens of text
    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=3)

    def gap(llm):
        out = llm.generate([list(prompt)], params, use_tqdm=False)[0].outputs[0]
        ids = torch.tensor([list(prompt) + out.token_ids])
        with torch.no_grad():
            logits = trainer(ids).logits[0, len(prompt) - 1:-1].float()
        theirs = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
        ours = torch.tensor([lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
        return (ours - theirs).abs().max().item()

    with LLM(kv_cache_memory=64 << 20, quantization="dequantize") as llm:  # (weights in blocks take no update)
        assert gap(llm) <= 1e-3
        optimizer = torch.optim.SGD(trainer.parameters(), lr=1e-2)  # one step of a toy loss: new weights
        ids = torch.tensor([list(prompt) * 2])
        trainer(ids, labels=ids).loss.backward()
        optimizer.step()
        trainer.zero_grad()
        assert gap(llm) > 0.1  # the engine's old weights no longer agree: the step moved them
        llm.update_weights_from_tensor(trainer.state_dict())
        assert gap(llm) <= 1e-3


@pytest.mark.parametrize("dtype,given", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                         (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("cuts", [(0, 100), (0, 10, 37, 70, 100), (0, 32, 64, 96, 100), (0, 5, 100)])
def test_assign_writes_parts_into_the_panels_as_packing_them_whole_would(cuts, dtype, given):
    """Linear.assign's parts, wherever they start and end (inside a panel, on its edge, whole
    panels at once), and in whatever float dtype they come (rounded to the weights' dtype on the
    way in, ties to even included), leave the panels equal to packing the whole new weight."""
    import ext
    from engine.models.linear import Linear
    if ext.cpu_kernels() is None:
        pytest.skip(f"CPU kernels unavailable: {ext.cpu_kernels_error()}")
    new = torch.randn(100, 48).to(given)
    if given == torch.float32:  # values halfway between two bf16 numbers: rounded to the even one
        ties = torch.randn(15, 16).bfloat16().float()
        ties.view(torch.int32).add_(0x8000)  # (half of a bf16's last bit, in fp32's bits)
        new[::7, ::3] = ties
    updated, packed = Linear(48, 100), Linear(48, 100)
    torch.nn.init.normal_(updated.weight)
    packed.weight.data = new.to(dtype).float()
    updated.pack_panels(dtype), packed.pack_panels(dtype)
    updated.pack_pick(), packed.pack_pick()  # (and the greedy pick's copy and bounds)
    for a, b in zip(cuts, cuts[1:]):
        updated.assign(new[a:b], a, dtype)
    assert torch.equal(updated.panels, packed.panels)
    assert torch.equal(updated.pick, packed.pick)
    assert not updated.weight.numel()  # (the plain weight was dropped by packing, and stays so)
    # a row's fp64 norms may differ in the last bits with how many rows are reduced at once (ATen
    # vectorizes across them), far inside the slack the bound's gamma term gives it
    torch.testing.assert_close(updated.pick_bounds, packed.pick_bounds, rtol=1e-12, atol=0)
