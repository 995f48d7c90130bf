"""An engine process over a shared KV pool (tests/kv/test_kv_pool_processes.py): generates greedily
for the prompt it is given, prints one JSON line (tokens, prefix statistics), then keeps its
pages until stdin closes or it is killed."""
import json
import sys

from engine import LLM, SamplingParams


def main(socket_path: str, layout: str, prompt: str) -> None:
    pool = socket_path if socket_path != "-" else None
    llm = LLM(model="random:smollm2-kv", kv_layout=layout, kv_pool=pool, kv_cache_memory=32 << 20, max_num_seqs=4,
              max_model_len=512)
    out = llm.generate([json.loads(prompt)], SamplingParams(temperature=0, max_tokens=8))[0]
    kv = llm.stats().kv
    print(json.dumps({"tokens": list(out.outputs[0].token_ids), "hits": kv.prefix_cache_hits,
                      "imported": kv.prefix_cache_imported}), flush=True)
    sys.stdin.readline()
    llm.engine.kv.audit()
    print("audited", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
