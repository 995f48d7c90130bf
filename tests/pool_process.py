"""A process attached to a shared pool, driven line by line over stdin (tests/vmm/test_vmm_processes.py).

`pool_process.py SOCKET [host|cuda]`: cuda imports the pool's pages through vkv's CudaBackend
(the real driver on a GPU, the driver emulator elsewhere). Commands: `write NAME VALUE` maps a
fresh page, fills it with VALUE and publishes it as NAME; `read NAME` looks NAME up, maps it and
prints the page's first byte; `held` prints how many pages this process holds; `leave` unmaps
everything, leaves the pool and prints what the CUDA driver still holds for this process
(handles, reservations, mappings). Each answer is one line; the process lives until stdin closes
or it is killed.
"""
import sys

import torch

from vmm import Reservation
from vmm.attach import AttachedPool


def main(path: str, kind: str) -> None:
    backend = None
    if kind == "cuda":
        from cuda_emulator import make_backend
        backend = make_backend()
    pool = AttachedPool(path, backend)
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
        elif cmd == "leave":
            for r in ranges:
                r.release()
            pool.close()
            import vmm
            if kind == "cuda" and vmm.cuda_unavailable_reason() is not None:  # the emulator counts
                from cuda_emulator import counts
                c = counts()
                print("driver", c.allocations, c.reservations, c.mappings, flush=True)
            else:  # host pages: nothing of the driver's; a real driver: not counted here
                print("driver", "uncounted" if kind == "cuda" else "0 0 0", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "host")
