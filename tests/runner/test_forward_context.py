"""The per-step ForwardContext belongs to the thread that runs the forward."""

from __future__ import annotations

import threading

import pytest

from runner.forward_batch import ForwardContext, forward_context, get_forward_context


def test_a_forward_on_another_thread_neither_sees_nor_resets_this_threads_context():
    """Two forwards overlapping on two threads (an engine's forward worker and a trainer's own pass
    through the model code) each read their own context, and leaving one restores only its thread's."""
    ctx_a, ctx_b = ForwardContext("a", None, None), ForwardContext("b", None, None)
    a_entered, b_entered, a_read, b_left = (threading.Event() for _ in range(4))
    seen: dict[str, object] = {}

    def thread_b():
        a_entered.wait(10)
        with forward_context(ctx_b):
            b_entered.set()
            seen["b"] = get_forward_context()
            a_read.wait(10)  # stay inside until thread A has read its context
        b_left.set()

    t = threading.Thread(target=thread_b)
    t.start()
    with forward_context(ctx_a):
        a_entered.set()
        assert b_entered.wait(10)
        seen["a while b inside"] = get_forward_context()
        a_read.set()
        assert b_left.wait(10)
        seen["a after b left"] = get_forward_context()
    t.join(10)
    assert seen == {"b": ctx_b, "a while b inside": ctx_a, "a after b left": ctx_a}
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
