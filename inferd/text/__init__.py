"""The torch-free text leaf: tokenizers and their loading, the detokenizer, chat templates, sampling
parameters and the GGUF metadata reader. The API, the engine and the model all use it; it imports
nothing of inferd's but itself, and never torch."""
