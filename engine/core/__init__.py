"""The engine loop: requests checked where they enter (`processor`), one step (`engine_core`:
schedule -> run -> sample -> update), outputs (`output_processor`), and `LLMEngine` over them."""
