"""bench/overlap.py runs end to end on a small workload: both schedules give the same tokens (it asserts so),
the ratio is the median of the pair ratios, and the pinned CPUs it reports are the worker's one and the rest."""

import os
import tempfile

from bench import overlap


def test_overlap_bench_small_run_reports_consistent_figures(tmp_path, monkeypatch):
    """One pair on the tiny preset: tokens checked equal inside, ratio = on/off of that pair, pinned roles
    disjoint when reported; --no-pin reports none; the checkpoint it wrote is gone afterwards."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = overlap.main(["--preset", "tiny", "--batch", "4", "--prompt-len", "8", "--output-len", "8", "--repeat", "1"])
    assert result["on_tok_s"] > 0 and result["off_tok_s"] > 0
    assert abs(result["ratio"] - result["on_tok_s"] / result["off_tok_s"]) < 1e-9
    assert result["num_overlapped_steps"] > 0
    pinned = result["pinned"]
    if pinned:  # pinned unless every CPU is claimed by another engine alive on this machine
        assert len(pinned["worker"]) == 1 and not set(pinned["worker"]) & set(pinned["scheduler"])
        assert set(pinned["worker"]) | set(pinned["scheduler"]) == os.sched_getaffinity(0)
    unpinned = overlap.main(["--preset", "tiny", "--batch", "2", "--prompt-len", "8", "--output-len", "4",
                             "--repeat", "1", "--no-pin"])
    assert unpinned["pinned"] == {}
    assert list(tmp_path.glob("bench_overlap_*")) == []  # each run's temporary checkpoint was removed
