"""Data parallelism: N engine processes over one KV pool behind one front door (replicas.py,
front_door.py), or replicas on a Ray cluster behind Ray Serve (ray_serve.py, ray_router.py)."""
