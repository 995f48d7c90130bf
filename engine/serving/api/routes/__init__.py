"""The server's routes, a router per family (vLLM's entrypoints/openai: a router and its
serving code per endpoint): generation (`completions`, `chat`), `models` and adapters, `admin`
(sleep, weights, KV limits), `tokenize` (detokenize, version) and `observe` (health, metrics).
Each route reads the one `ServerState` (engine/serving/api/state.py) and calls the engines
through their AsyncEngine.
`build_app` (engine/serving/api/server.py) mounts ROUTERS in this order."""
from engine.serving.api.routes import admin, chat, completions, models, observe, tokenize

ROUTERS = [observe.router, admin.router, models.router, tokenize.router, completions.router, chat.router]
