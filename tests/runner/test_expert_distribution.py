"""The expert-distribution recorder on a tiny Qwen3-MoE and Mixtral: its counts equal counts derived from
HF's router logits on the same tokens (mode stat accumulated over prefill and decode passes, mode
per_pass one record per forward), dumps are written in SGLang's file format and reset the record, it
costs nothing when off, and bad modes are refused by name."""

from __future__ import annotations

import pytest
import torch

from runner.expert_distribution import ExpertDistributionRecorder
from tests.checkpoints import load_hf_model
from tests.moe_checkpoints import NUM_EXPERTS, TOP_K, expert_counts, hf_routed_experts, make_moe_checkpoint
from tests.runner.driver import RunnerDriver, make_runner

# Qwen3-MoE with a dense middle layer (its row must stay zero) and Mixtral.
CASES = [("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])), ("mixtral", {})]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request, tmp_path_factory):
    """(checkpoint path, HF reference model)."""
    arch, kw = request.param
    path = make_moe_checkpoint(tmp_path_factory.mktemp(f"moe-{arch}"), arch, **kw)
    return path, load_hf_model(path)


def _workload(runner, seed: int = 0):
    """Prefill 3 ragged prompts, then 4 batched decode steps. Returns (each request's full token sequence,
    [(forward mode, token ids of that pass per request)]) so an oracle can recount every pass."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 384, (n,), generator=gen).tolist() for n in (2, 7, 13)]
    fed = torch.randint(4, 384, (3, 4), generator=gen)
    drv = RunnerDriver(runner)
    rows = [drv.new_request() for _ in prompts]
    drv.extend(rows, prompts)
    passes = [("extend", [list(range(len(p))) for p in prompts])]
    for step in range(fed.shape[1]):
        drv.decode(rows, fed[:, step].tolist())
        passes.append(("decode", [[len(p) + step] for p in prompts]))
    return [p + fed[i].tolist() for i, p in enumerate(prompts)], passes


def test_stat_counts_equal_hf_router_counts(case):
    """Mode stat: logical_count [num_layers, num_experts] after a prefill and 4 decode steps equals the
    top-k counts of HF's router logits over the same sequences; a dense layer's row is zero."""
    path, hf = case
    runner = make_runner(path)
    recorder = runner.model.expert_recorder
    recorder.start_record()
    seqs, passes = _workload(runner)
    recorder.stop_record()
    dump = recorder.dump_record()
    want = sum(expert_counts(hf_routed_experts(hf, s), NUM_EXPERTS) for s in seqs)
    assert dump["logical_count"].shape == (hf.config.num_hidden_layers, NUM_EXPERTS)
    assert torch.equal(dump["logical_count"], want)
    assert dump["num_forward_passes"] == len(passes) and dump["rank"] == 0
    assert dump["logical_count"].sum() == sum(len(s) for s in seqs) * TOP_K * len(runner.model.moe_config.sparse_layers)
    if hf.config.model_type == "qwen3_moe":
        assert not dump["logical_count"][1].any()  # mlp_only_layers=[1]


def test_per_pass_records_equal_hf_counts_of_each_pass(case):
    """Mode per_pass: one record per forward pass whose counts equal HF's for exactly that pass's tokens;
    logical_count is their sum."""
    path, hf = case
    runner = make_runner(path)
    recorder = runner.model.expert_recorder
    recorder.mode = "per_pass"
    recorder.start_record()
    seqs, passes = _workload(runner, seed=1)
    dump = recorder.dump_record()
    routed = [hf_routed_experts(hf, s) for s in seqs]  # [len, num_layers, top_k] per request
    assert [r["forward_pass_id"] for r in dump["records"]] == list(range(len(passes)))
    for record, (mode, positions) in zip(dump["records"], passes, strict=True):
        want = sum(expert_counts(r[pos], NUM_EXPERTS) for r, pos in zip(routed, positions))
        assert torch.equal(record["global_physical_count"], want), record["forward_pass_id"]
        assert record["num_tokens"] == sum(len(pos) for pos in positions)
        assert record["forward_mode"] == (1 if mode == "extend" else 2)
    assert torch.equal(dump["logical_count"], sum(r["global_physical_count"] for r in dump["records"]))
    identity = dump["last_physical_to_logical_map"]
    assert torch.equal(identity[0], torch.arange(NUM_EXPERTS)) and identity.shape[0] == hf.config.num_hidden_layers


def test_dump_writes_sglang_file_and_resets(case, tmp_path):
    """dump_record(dir) writes expert_distribution_recorder_*.pt equal to what it returns, and the next
    dump (nothing recorded since) is all zeros; start_record() restarts from zero."""
    path, _ = case
    runner = make_runner(path)
    recorder = runner.model.expert_recorder
    recorder.start_record()
    _workload(runner)
    recorder.start_record()  # drops what was recorded so far
    _workload(runner, seed=2)
    recorder.stop_record()
    dump = recorder.dump_record(tmp_path / "out")
    files = list((tmp_path / "out").glob("expert_distribution_recorder_*.pt"))
    assert len(files) == 1
    saved = torch.load(files[0])
    assert torch.equal(saved["logical_count"], dump["logical_count"])
    assert dump["num_forward_passes"] == 5 and saved["num_forward_passes"] == 5  # second workload only
    again = recorder.dump_record()
    assert not again["logical_count"].any() and again["num_forward_passes"] == 0


def test_off_costs_nothing_and_records_nothing(case, monkeypatch):
    """With recording and capture off no hook runs at all (they would raise here); stop_record ends
    counting; capture alone does not count, and recording alone does not capture."""
    path, _ = case
    runner = make_runner(path)
    recorder = runner.model.expert_recorder

    def boom(*args, **kwargs):
        raise AssertionError("a recorder hook ran while the recorder was off")

    for hook in ("on_forward_pass_start", "on_select_experts", "on_forward_pass_end"):
        monkeypatch.setattr(recorder, hook, boom)
    _workload(runner)
    monkeypatch.undo()

    recorder.start_record()
    recorder.stop_record()
    _workload(runner)  # after stop: not counted
    assert recorder.dump_record()["num_forward_passes"] == 0
    recorder.set_capture_routed_experts(True)
    _workload(runner)
    assert recorder.last_routed_experts is not None and recorder.dump_record()["num_forward_passes"] == 0
    recorder.set_capture_routed_experts(False)
    recorder.start_record()
    _workload(runner)
    assert recorder.last_routed_experts is None and recorder.dump_record()["num_forward_passes"] == 5


def test_bad_modes_are_refused_by_name():
    """An unknown mode, or a mode switch while recording, is refused with a message naming it."""
    with pytest.raises(ValueError, match="'tokens'"):
        ExpertDistributionRecorder(2, 4, 2, "cpu", mode="tokens")
    recorder = ExpertDistributionRecorder(2, 4, 2, "cpu")
    with pytest.raises(ValueError, match="'per_token'"):
        recorder.mode = "per_token"
    recorder.start_record()
    with pytest.raises(RuntimeError, match="per_pass"):
        recorder.mode = "per_pass"
    assert recorder.mode == "stat" and recorder.recording
