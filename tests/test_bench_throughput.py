"""bench/throughput drops a decode ms/step estimate that is the difference of two prefill-dominated runs, and a
floor whose timing was disturbed."""

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


def test_a_floor_slower_than_the_decode_step_is_dropped_with_a_note():
    """decode 0.13 ms against a floor read at 39.97 ms (its timing descheduled): the ratio would say the step
    beats its own linears 300x, so the floor figures go and a note says why; a plausible floor stays."""
    from bench.throughput import drop_implausible_floor

    row = dict(decode_ms=0.13, floor_ms=39.97, decode_over_floor=0.0033, floor_cpu_ms=0.2, decode_over_floor_cpu=0.6)
    drop_implausible_floor(row)
    assert row["decode_ms"] == 0.13 and not {"floor_ms", "decode_over_floor", "floor_cpu_ms"} & row.keys()
    assert "39.97" in row["floor_note"] and "disturbed" in row["floor_note"]
    kept = dict(decode_ms=6.6, floor_ms=5.1, decode_over_floor=1.29)
    drop_implausible_floor(kept)
    assert kept == dict(decode_ms=6.6, floor_ms=5.1, decode_over_floor=1.29)
