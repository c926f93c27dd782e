"""bench/throughput drops a decode ms/step estimate that is the difference of two prefill-dominated runs."""

from bench.throughput import MIN_DECODE_SHARE, drop_unreliable_decode


def test_decode_estimate_kept_when_decode_is_a_large_share_of_the_run():
    """63 steps of 80 ms in a 6 s run (84% decode): the figure and its floor stay."""
    row = dict(seconds=6.0, decode_ms=80.0, floor_ms=60.0, decode_over_floor=80 / 60)
    drop_unreliable_decode(row, output_len=64)
    assert row["decode_ms"] == 80.0 and row["floor_ms"] == 60.0 and "decode_ms_note" not in row


def test_decode_estimate_dropped_when_prefill_dominates_or_negative():
    """31 steps of 150 ms in a 27 s run (17% decode), and a negative estimate, become notes."""
    assert 31 * 0.150 / 27 < MIN_DECODE_SHARE
    for ms in (150.0, -8.8):
        row = dict(seconds=27.0, decode_ms=ms, decode_ms_all=[ms], floor_ms=42.0, decode_over_floor=ms / 42)
        drop_unreliable_decode(row, output_len=32)
        assert not {"decode_ms", "decode_ms_all", "floor_ms", "decode_over_floor"} & row.keys()
        assert "--output-len" in row["decode_ms_note"] and f"{ms:.2f}" in row["decode_ms_note"]


def test_rows_without_a_decode_figure_are_left_alone():
    """A failed backend (no seconds) or a 1-token workload has nothing to check."""
    failed, short = dict(error="vLLM missing"), dict(seconds=1.0, tokens=16)
    drop_unreliable_decode(failed, 32)
    drop_unreliable_decode(short, 1)
    assert failed == dict(error="vLLM missing") and short == dict(seconds=1.0, tokens=16)
