"""bench/lora.py runs end to end on a small workload, prints each variant's rate, and removes the checkpoint
and adapters it wrote."""

import tempfile

from bench import lora


def test_lora_bench_small_run_prints_rates_and_cleans_up(tmp_path, monkeypatch, capsys):
    """Tiny preset, two prompts, one repeat: base/segmented/masked rates printed; no bench-lora-* left."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lora.main(["--preset", "tiny", "--batch", "2", "--num-adapters", "2", "--rank", "4", "--prompt-len", "4",
               "--output-len", "4", "--repeat", "1", "--skip-sync"])
    out = capsys.readouterr().out
    for label in ("base model", "mixed adapters, segmented", "mixed adapters, masked"):
        assert label in out and "tok/s" in out.split(label, 1)[1].splitlines()[0]
    assert list(tmp_path.glob("bench-lora-*")) == []
