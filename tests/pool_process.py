"""A process attached to a shared pool, driven line by line over stdin (tests/test_vmm_processes.py).

Commands: `write NAME VALUE` maps a fresh page, fills it with VALUE and publishes it as NAME;
`read NAME` looks NAME up, maps it and prints the page's first byte; `held` prints how many
pages this process holds. Each answer is one line; the process lives until stdin closes or it
is killed.
"""
import sys

import torch

from vmm import Reservation
from vmm.attach import AttachedPool


def main(path: str) -> None:
    pool = AttachedPool(path)
    ranges = []
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "write":
            r = Reservation(pool, pool.page_size)
            r.map_new(0)
            r.view(torch.uint8, (pool.page_size,), check=True).fill_(int(args[1]))
            pool.publish([(args[0].encode(), (r.page_at(0),))])
            ranges.append(r)
            print("ok", r.page_at(0), flush=True)
        elif cmd == "read":
            found = pool.lookup([args[0].encode()])
            if not found:
                print("missing", flush=True)
                continue
            pages = found[0]
            r = Reservation(pool, pool.page_size)
            r.map(0, pages[0])
            pool.drop(pages[0])  # the mapping holds it now
            ranges.append(r)
            print("value", int(r.view(torch.uint8, (pool.page_size,), check=True)[0]), flush=True)
        elif cmd == "held":
            print("held", sum(1 for c in pool.local if c), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
