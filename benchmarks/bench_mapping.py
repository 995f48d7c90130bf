"""Page-mapping latency of a vmm backend over a sweep of page sizes: per call (create, map,
set-access, unmap, release) and per batched run, as the KV caches map. The same as
`vkv profile-mapping` (engine/profile_mapping.py), kept here beside the other benchmarks.

    python benchmarks/bench_mapping.py --backend host --pages 256 \
        --json benchmarks/results/cpu/mapping-host.json --plot benchmarks/results/cpu/mapping-host.png
"""
from __future__ import annotations

import argparse
import sys

from engine import profile_mapping


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    profile_mapping.add_cli_args(parser)
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_mapping.py " + " ".join(sys.argv[1:] if argv is None else argv)
    return profile_mapping.run(args, command)


if __name__ == "__main__":
    main()
