"""vkv against transformers' own continuous batching (`generate_batch`, its paged attention) on
the same GPU, the same random-weight model and the same requests.

    python benchmarks/bench_vs_transformers_cb.py --json DIR/vs_transformers_cb.json

Both sides get --requests ShareGPT prompts at once and decode exactly --output-len tokens each
(transformers' generate_batch takes one max_new_tokens for all requests, so the ShareGPT reply
lengths are not used; vkv asks ignore_eos, transformers gets no EOS id). transformers loads the
model with its defaults (sdpa; generate_batch switches to its paged kernel itself) in bf16, and
runs its default continuous-batching settings (CUDA graphs where it captures them); vkv runs its
defaults (decode as CUDA graphs, the interleaved layout on FlashAttention). Output tok/s over
the tokens each side produced, median and range of --repeats runs after one warm-up run, one
side after the other (each sizes its KV cache from the memory it finds free; transformers
first); the ratio is vkv's median over transformers'.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_info, save  # noqa: E402
from sharegpt import sample_requests  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models import load_tokenizer  # noqa: E402


def transformers_model(spec: str, device: str):
    """The engine's random:<preset> shape as a transformers model (random weights, bf16)."""
    import transformers

    from engine.models.presets import PRESETS

    config = transformers.AutoConfig.for_model(**PRESETS[spec.removeprefix("random:")])
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def run_transformers(model, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        outs = model.generate_batch(inputs=prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.generated_tokens) for o in outs.values())


def run_vkv(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def measure(name: str, run, repeats: int) -> list[float]:
    """Output tok/s of `repeats` runs after a warm-up run (compiles, graph captures, the allocator)."""
    run()
    rates = []
    for _ in range(repeats):
        elapsed, tokens = run()
        rates.append(tokens / elapsed)
        print(f"{name:12s} {tokens / elapsed:9.1f} output tok/s ({tokens} tokens in {elapsed:.2f} s)", flush=True)
    return rates


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-3-8b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # (cpu: a smoke run of the script)
    p.add_argument("--json", dest="json_path")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_vs_transformers_cb: needs a CUDA GPU")
    import transformers

    requests = sample_requests(load_tokenizer(args.model), args.requests, 0, max_output=args.output_len)
    prompts = [r.prompt_ids for r in requests]
    rates = {}
    # one side at a time (each sizes its KV cache from the memory it finds free): transformers, then vkv
    model = transformers_model(args.model, args.device)
    rates["transformers"] = measure("transformers", lambda: run_transformers(model, prompts, args.output_len),
                                    args.repeats)
    del model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(model=args.model, device=args.device, dtype="bfloat16", max_num_seqs=max(args.requests, 1),
              enable_prefix_caching=False)  # (each run computes its prompts)
    rates["vkv"] = measure("vkv", lambda: run_vkv(llm, prompts, args.output_len), args.repeats)
    result = {"benchmark": "vs_transformers_continuous_batching", "model": args.model, "dtype": "bfloat16",
              "requests": args.requests, "output_len": args.output_len, "repeats": args.repeats,
              "transformers": transformers.__version__, "vkv_decode": llm.engine.platform()["decode"],
              "output_tok_s": {k: {"median": statistics.median(v), "range": [min(v), max(v)], "runs": v}
                               for k, v in rates.items()},
              "machine": machine_info(),
              "command": "python benchmarks/bench_vs_transformers_cb.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    result["vkv_over_transformers"] = (result["output_tok_s"]["vkv"]["median"]
                                       / result["output_tok_s"]["transformers"]["median"])
    print(f"vkv / transformers: {result['vkv_over_transformers']:.2f}x")
    save(result, args.json_path, None, None)
    return result


if __name__ == "__main__":
    main()
