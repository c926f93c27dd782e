"""Atomic HF checkpoints: shards, index, config, tied weights, and no half-written directories."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from weight_sync import disk, save_hf_checkpoint


def _load_dir(path):
    """All tensors of a checkpoint dir, via the index when there is one."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return load_file(path / "model.safetensors")
    files = set(json.loads(index.read_text())["weight_map"].values())
    out = {}
    for f in sorted(files):
        out.update(load_file(path / f))
    return out


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 16, generator=g),  # 4 KiB
        "b.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),  # 2 KiB
        "c.bias": torch.randn(16, generator=g),
        "d.steps": torch.arange(7),
    }


def test_single_file_round_trip(tmp_path):
    """Small inputs give one model.safetensors, no index, bit-exact tensors and the config as given."""
    state = _state()
    out = save_hf_checkpoint(state, tmp_path / "ckpt", config={"model_type": "toy"})
    assert out == tmp_path / "ckpt"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == {"model_type": "toy"}
    loaded = _load_dir(out)
    assert loaded.keys() == state.keys()
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t)


def test_sharded_round_trip_through_index(tmp_path):
    """Past max_shard_bytes tensors split into -of-N shards; the index maps every name and total_size."""
    state = _state()
    out = save_hf_checkpoint(state, tmp_path / "ckpt", max_shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(state)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert not (out / "model.safetensors").exists()
    loaded = _load_dir(out)
    for name, t in state.items():
        assert torch.equal(loaded[name], t)


def test_name_map_config_path_and_extra_files(tmp_path):
    """name_map renames and skips, a config path is copied, extra files land beside the weights."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    config = tmp_path / "src_config.json"
    config.write_text('{"model_type": "toy"}')
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")

    def name_map(name):
        return None if name.startswith("1.") else f"model.{name}"

    out = save_hf_checkpoint(model, tmp_path / "ckpt", config=config, name_map=name_map, extra_files=[tok])
    assert sorted(_load_dir(out)) == ["model.0.bias", "model.0.weight"]
    assert (out / "config.json").read_text() == '{"model_type": "toy"}'
    assert (out / "tokenizer.json").read_text() == "{}"


def test_shared_storage_and_grad_tensors_are_saved(tmp_path):
    """Tied weights and views of one buffer are cloned apart; parameters with grad are detached."""
    base = nn.Parameter(torch.randn(8, 4))
    flat = torch.arange(12.0)
    state = {"embed.weight": base, "lm_head.weight": base, "x": flat[:6].view(2, 3), "y": flat[6:].view(3, 2)}
    loaded = _load_dir(save_hf_checkpoint(state, tmp_path / "ckpt"))
    assert torch.equal(loaded["embed.weight"], base.detach())
    assert torch.equal(loaded["lm_head.weight"], base.detach())
    assert torch.equal(loaded["x"], flat[:6].view(2, 3)) and torch.equal(loaded["y"], flat[6:].view(3, 2))


def test_replaces_existing_dir_completely(tmp_path):
    """Saving over an existing checkpoint leaves only the new files and no temp or aside dirs."""
    out = tmp_path / "ckpt"
    save_hf_checkpoint(_state(), out, max_shard_bytes=4096)
    save_hf_checkpoint({"only": torch.ones(3)}, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(_load_dir(out)) == ["only"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_failure_while_writing_leaves_old_dir_untouched(tmp_path, monkeypatch):
    """An error after some shards were written leaves the existing out_dir byte-identical and no temp dir."""
    out = tmp_path / "ckpt"
    save_hf_checkpoint({"old": torch.zeros(4)}, out, config={"v": 1})
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    calls = []
    real_save_file = disk.save_file

    def flaky_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        real_save_file(*args, **kwargs)

    monkeypatch.setattr(disk, "save_file", flaky_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(_state(), out, config={"v": 2}, max_shard_bytes=4096)
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_unsaveable_tensor_leaves_old_dir_untouched(tmp_path):
    """A sparse tensor (unsaveable) after a flushed shard fails the save without touching out_dir."""
    out = tmp_path / "ckpt"
    save_hf_checkpoint({"old": torch.zeros(4)}, out)
    before = (out / "model.safetensors").read_bytes()
    bad = {"ok": torch.zeros(64), "sparse": torch.eye(8).to_sparse()}
    with pytest.raises(RuntimeError):
        save_hf_checkpoint(bad, out, max_shard_bytes=128)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_bad_arguments_raise_before_writing(tmp_path):
    """Missing or clashing extra files, duplicate names and empty input are refused, leaving nothing."""
    with pytest.raises(FileNotFoundError):
        save_hf_checkpoint(_state(), tmp_path / "a", extra_files=[tmp_path / "missing.json"])
    clash = tmp_path / "config.json"
    clash.write_text("{}")
    with pytest.raises(ValueError, match="overwrite"):
        save_hf_checkpoint(_state(), tmp_path / "a", extra_files=[clash])
    with pytest.raises(ValueError, match="duplicate"):
        save_hf_checkpoint(_state(), tmp_path / "a", name_map=lambda n: "same")
    with pytest.raises(ValueError, match="no tensors"):
        save_hf_checkpoint({}, tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_tiny_llama_loads_with_identical_logits(tmp_path):
    """A saved LlamaForCausalLM reloads via AutoModelForCausalLM.from_pretrained with identical logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    out = save_hf_checkpoint(model, tmp_path / "llama", config=config.to_dict(), max_shard_bytes=16 << 10)
    assert (out / "model.safetensors.index.json").exists()

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    input_ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids).logits  # [batch, seq, vocab]
        got = reloaded(input_ids).logits
    assert torch.equal(got, want)


def test_concurrent_writers_each_land_whole_and_leave_nothing_behind(tmp_path):
    """Four threads saving to one out_dir at once (each its own open of the lock, as separate processes would
    be): no save fails, the final checkpoint is one writer's whole save, and no aside copy is left."""
    import threading

    out, errors = tmp_path / "ckpt", []

    def writer(i: int) -> None:
        sd = {"w": torch.full((8, 8), float(i)), "b": torch.full((64,), float(i))}
        for k in range(25):
            try:
                save_hf_checkpoint(sd, out, config={"writer": i, "k": k})
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    i = json.loads((out / "config.json").read_text())["writer"]
    tensors = load_file(out / "model.safetensors")
    assert torch.equal(tensors["w"], torch.full((8, 8), float(i))) and torch.equal(tensors["b"], torch.full((64,), float(i)))
