"""Serving over HTTP, in three packages and the edge they share:

  api/    one server's OpenAI-compatible app: its state, request shapes, routes and streams
  loop/   the thread that bridges the app to an engine: commands in, outputs out, the
          tokenizer threads, the metrics the loop observes
  dp/     data parallelism: the replicas' front door over one KV pool, and replicas on Ray Serve
  edge.py who the client is, the key, OpenAI's error object and the failed stream's end, written
          once for every front door; http.py the guard rails before any of them; options.py the
          flags
"""
