"""What a request is, in and out: prompts (`inputs`), sampling parameters, the sequence a
prompt becomes, structured outputs, outputs, detokenization. Imports nothing else of the engine's."""
