"""Shared building blocks for the decoder models: norms, rotary, fused linears, MLP, embeddings,
logits processing and the attention layer that defers to the chosen backend. Below them, ops.py holds
the opaque ops a captured CPU step calls (and the prepacked linear); prepack.py is the CPU pass that
gives linears their oneDNN-prepacked shadows."""
