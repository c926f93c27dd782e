"""bench/decode_floor.floor_step runs on any CPU: prepacked where oneDNN can pack the dtype, dense otherwise."""

import torch

from bench.decode_floor import floor_step, linear_shapes
from runner.layers.prepack import is_supported

CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=128)


def test_linear_shapes_match_a_hand_count():
    """qkv, o, gate|up, down per layer and the LM head, as (out, in)."""
    layer, head = linear_shapes(CFG)
    assert layer == [((4 + 2 * 2) * 8, 32), (32, 32), (128, 32), (32, 64)]
    assert head == (128, 32)


def test_floor_runs_for_each_dtype_and_packs_only_where_supported():
    """bf16 on an AVX2-only CPU falls back to dense linears instead of raising in oneDNN's reorder."""
    for dtype in (torch.float32, torch.bfloat16):
        step = floor_step(CFG, 4, dtype)
        assert step.packed == is_supported(torch.device("cpu"), dtype)
        step()
