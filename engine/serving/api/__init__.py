"""One server's OpenAI-compatible app (`build_app`, `vkv serve`): routes in routes/, what they
read in state.py, the request and response shapes in protocol.py, answers in streams.py."""
