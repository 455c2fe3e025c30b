"""The decode loops over a transformers model: prompts, prefill, one step's model call and its
token, stopping, ``sfi.generate``, exact mode and the compiled step."""
