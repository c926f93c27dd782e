"""Prompt logprobs and token_ids_logprob over /generate: the same values as the Engine called directly."""

from __future__ import annotations


def test_input_logprobs_over_http_equal_engine(server, client):
    """/generate with logprob_start_len, top_logprobs_num and token_ids_logprob returns the Engine's
    input_* and output_* logprob lists (text stripped unless return_text_in_logprobs), None entries included."""
    engine = server.engine
    body = dict(input_ids=[5, 6, 7, 8, 9, 10, 11], sampling_params=dict(temperature=0, max_new_tokens=3,
                                                                        ignore_eos=True),
                return_logprob=True, logprob_start_len=1, top_logprobs_num=2, token_ids_logprob=[4, 9])
    assert client.post("/flush_cache").status_code == 200  # both calls prefill from scratch: same arithmetic
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["meta_info"]
    assert engine.flush_cache()
    want = engine.generate(**body)["meta_info"]
    def norm(key, v):  # [logprob, token id] per entry; JSON turns tuples into lists
        if key.endswith("_token_logprobs"):
            return [[e[0], e[1]] for e in v]
        return [None if step is None else [[e[0], e[1]] for e in step] for step in v]

    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs"):
        assert norm(key, got[key]) == norm(key, want[key]), key
    assert got["input_token_logprobs"][0][0] is None and len(got["input_token_logprobs"]) == 6
    assert all(e[2] is None for e in got["input_token_logprobs"])
    with_text = client.post("/generate", json=body | dict(return_text_in_logprobs=True)).json()["meta_info"]
    assert [e[2] for e in with_text["input_token_logprobs"]] == [e[2] for e in want["input_token_logprobs"]]
