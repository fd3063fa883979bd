"""The model's layers: attention over the paged cache, RoPE, the linear layers (dense and packed)."""
