"""Shared pieces of the delta-sync tests: a trainer taking Adam steps, and the full-update oracle.

The oracle for "the engine holds exactly the trainer's cast" is independent of the delta code: a
reference engine given a plain full `update_weights_from_tensor` of the same cast, compared by
`get_weights_checksum` (SHA-256 of every parameter's bytes) and by greedy outputs.
"""

from __future__ import annotations

import torch

from tests.checkpoints import load_hf_model
from tests.rollout.oracle import random_prompts

ENGINE_KW = dict(show_progress=False, max_total_tokens=512, max_running_requests=8, disable_radix_cache=True,
                 dtype="bfloat16")
PROMPTS = random_prompts([5, 9, 3], seed=11)


class Trainer:
    """The checkpoint's HF model (fp32 master weights) and Adam at `lr`, stepping on random tokens."""

    def __init__(self, ckpt, lr: float, seed: int = 0) -> None:
        self.model = load_hf_model(ckpt).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.g = torch.Generator().manual_seed(seed)
        self.vocab = self.model.config.vocab_size

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def step(self) -> None:
        ids = torch.randint(0, self.vocab, (2, 12), generator=self.g)
        self.opt.zero_grad()
        self.model(ids, labels=ids).loss.backward()
        self.opt.step()

    def cast(self, dtype=torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach().to(dtype)) for n, p in self.model.named_parameters()]


def greedy(engine) -> list[list[int]]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": 6})
    return [o["output_ids"] for o in outs]


def greedy_each(engine) -> list[list[int]]:
    """Greedy outputs of each prompt alone. An EngineGroup splits a batch over its engines, and bf16
    logits depend on the batch a row runs in (an AVX2 CPU's emulated bf16 GEMM picks kernels by rows):
    one prompt per call gives every side the same batch, so only the weights can differ."""
    sp = {"temperature": 0.0, "max_new_tokens": 6}
    return [engine.generate(input_ids=p, sampling_params=sp)["output_ids"] for p in PROMPTS]


def checksum(engine) -> str:
    return engine.get_weights_checksum()["checksum"]


def assert_equals_full_update(engine, reference, trainer: Trainer, outputs: bool = False) -> None:
    """`engine` holds what `reference` holds after a full update of the trainer's cast."""
    ok, msg = reference.update_weights_from_tensor(trainer.cast())
    assert ok, msg
    assert checksum(engine) == checksum(reference)
    if outputs:
        assert greedy(engine) == greedy(reference)


def run_steps(ds, trainer: Trainer, target_checksum, reference, lrs=(1e-6, 1e-6, 1e-3), serving=None) -> None:
    """A full first sync, then one Adam step per lr, each followed by a delta sync; after each the target's
    checksum equals `reference` given the same cast in full; at the end `serving` (something with
    generate) gives the reference's greedy outputs."""
    ok, msg = ds.sync(trainer.model)
    assert ok and ds.last["mode"] == "full", msg
    for lr in lrs:
        trainer.set_lr(lr)
        trainer.step()
        ok, msg = ds.sync(trainer.model)
        assert ok and ds.last["mode"] == "delta" and ds.last["elements_changed"] > 0, msg
        ok, msg = reference.update_weights_from_tensor(trainer.cast())
        assert ok, msg
        assert target_checksum() == checksum(reference)
    if serving is not None:
        got, want = greedy_each(serving), greedy_each(reference)
        assert got == want, (got, want)


def stale_then_fallback(ds, trainer: Trainer, other: Trainer, write_other, target_checksum, reference) -> None:
    """Another writer in between: the delta is refused with nothing changed; fallback=True syncs in full."""
    other.step()
    ok, msg = write_other(other)
    assert ok, msg
    before = target_checksum()
    trainer.step()
    ok, msg = ds.sync(trainer.model, fallback=False)
    assert not ok and "stale base" in msg, msg
    assert target_checksum() == before
    ok, msg = ds.sync(trainer.model, fallback=True)  # the refusal dropped the baseline: a full sync now
    assert ok and ds.last["mode"] == "full", msg
    assert reference.update_weights_from_tensor(trainer.cast())[0]
    assert target_checksum() == checksum(reference)
