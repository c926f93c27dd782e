"""Shared building blocks for the decoder models: norms, rotary, fused linears, MLP, embeddings,
logits processing and the attention layer that defers to the chosen backend."""
