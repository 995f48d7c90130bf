"""Page-mapping latency; the same code as `vkv profile-mapping`.

    python benchmarks/bench_mapping.py --backend host --json out.json --plot out.png
"""
from vmm.profiler import main

if __name__ == "__main__":
    main()
