"""A scheduler step that raises fails the requests in flight with the reason and leaves the engine
serving: no caller blocks forever, no slot leaks."""

from __future__ import annotations

import threading

from tests.rl_surface.conftest import make_engine, read_state_dict, run


def test_step_failure_finishes_streams_and_engine_recovers(ckpt_pair, reference_outputs):
    """Continuing with invalid weights aborts the in-flight stream with the reason; after an update
    the engine serves exactly like a fresh one and every pool slot is free again."""
    a, _ = ckpt_pair("llama")
    engine = make_engine(a, enable_memory_saver=True)
    try:
        engine.pause_generation()
        stream = engine.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=40, ignore_eos=True),
                                 stream=True)
        engine.release_memory_occupation()
        engine.resume_memory_occupation()  # weights are now invalid (no backup)
        engine.continue_generation()
        chunks: list = []
        reader = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
        reader.start()
        reader.join(30)
        assert not reader.is_alive(), "the stream never finished"
        reason = chunks[-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "released without CPU backup" in reason["message"]
        assert engine.scheduler.num_in_flight() == 0 and not engine._reqs
        assert engine.runner.req_to_token_pool.available_size() == engine.runner.req_to_token_pool.size
        ok, msg = engine.update_weights_from_tensor(list(read_state_dict(a).items()))
        assert ok, msg
        assert run(engine) == reference_outputs(a)
    finally:
        engine.shutdown()


def test_single_prompt_larger_than_kv_pool_finishes_with_abort(ckpt_pair):
    """A lone request that can never fit the KV pool comes back as abort naming max_total_tokens
    (it used to leave the caller waiting forever when nothing else was running)."""
    a, _ = ckpt_pair("llama")
    engine = make_engine(a, max_total_tokens=40)
    try:
        result: list = []
        caller = threading.Thread(target=lambda: result.append(engine.generate(
            input_ids=list(range(5, 64)), sampling_params=dict(max_new_tokens=4))), daemon=True)
        caller.start()
        caller.join(30)
        assert not caller.is_alive(), "generate never returned"
        reason = result[0]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "max_total_tokens" in reason["message"]
        assert engine.generate(input_ids=[5, 6, 7], sampling_params=dict(max_new_tokens=2))["output_ids"]
    finally:
        engine.shutdown()
