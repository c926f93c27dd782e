"""RLConfig: every knob of the GRPO/PPO loops, validated with messages a user can act on, and the
argparse CLI built from it (so `--help` and the defaults can never drift apart)."""

from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from trainers.tasks import TASK_NAMES

DEMO_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "demo-model")


@dataclass
class RLConfig:
    model: str = field(default=DEMO_MODEL, metadata={"help": "HF checkpoint dir (default: the shipped demo model)"})
    task: str = field(default="toy", metadata={"help": "task name: toy | math"})
    steps: int = field(default=30, metadata={"help": "RL steps (rollout + update each)"})
    prompts_per_step: int = field(default=16, metadata={"help": "prompts per step (batch size)"})
    group_size: int = field(default=8, metadata={"help": "samples per prompt (GRPO group, G)"})
    lr: float = field(default=5e-6, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    kl_coef: float = field(default=0.0, metadata={"help": "k3 KL penalty to the initial policy (0 = no ref model)"})
    clip_eps: float = field(default=0.2, metadata={"help": "PPO clip epsilon"})
    tis_cap: float = field(default=2.0, metadata={"help": "truncated IS cap for rollout/trainer mismatch (0 = off)"})
    updates_per_step: int = field(default=1, metadata={"help": "optimizer steps per rollout batch"})
    max_new_tokens: int = field(default=8, metadata={"help": "completion length limit"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the rollouts"})
    device: str = field(default="cpu", metadata={"help": "cpu | cuda"})
    engine_mem_fraction: float = field(default=0.3, metadata={"help": "engine mem_fraction_static (GPU)"})
    num_engines: int = field(default=1, metadata={"help": "rollout engines; > 1 runs them as Ray actors "
                                                          "(a local Ray cluster is started if none is)"})
    tp_size: int = field(default=1, metadata={"help": "tensor-parallel size of each engine"})
    bucket_mb: int = field(default=512, metadata={"help": "weight-sync bucket size in MB"})
    delta_sync: bool = field(default=False, metadata={"help": "after the first full sync, send only the elements "
                                                              "whose bits changed (exact; pays with --dtype "
                                                              "bfloat16, where most elements do not change)"})
    full_sync_every: int = field(default=0, metadata={"help": "with --delta-sync, a full sync every K syncs "
                                                              "(0 = only the first and after a refusal)"})
    offload_trainer: bool = field(default=False, metadata={"help": "offload optimizer state and trainer params "
                                                                   "to host while the engine generates"})
    seed: int = field(default=0, metadata={"help": "random seed (prompts, sampling, init)"})
    eval_every: int = field(default=5, metadata={"help": "greedy eval on the task's eval set every N steps (0 = off)"})
    output_dir: str = field(default="runs/grpo", metadata={"help": "metrics.jsonl, plot and final checkpoint"})
    no_wandb: bool = field(default=False, metadata={"help": "disable wandb logging"})
    wandb_project: str = field(default="rollout-engine", metadata={"help": "wandb project (offline unless "
                                                                           "WANDB_API_KEY/WANDB_MODE say otherwise)"})
    save_final: bool = field(default=False, metadata={"help": "save the trained model to output_dir/final"})
    deterministic: bool = field(default=False, metadata={"help": "batch-invariant engine and a trainer logprob "
                                                                "pass through the engine's own model code: "
                                                                "rollout/trainer logprobs bitwise equal"})
    dtype: str = field(default="float32", metadata={"help": "engine and policy dtype: float32 | bfloat16"})
    routing_replay: bool = field(default=False, metadata={"help": "MoE policies: the trainer's forward uses the "
                                                                  "experts the rollout routed each token to (R3)"})
    lora_rank: int = field(default=0, metadata={"help": "train a PEFT LoRA adapter of this rank (0 = full "
                                                        "fine-tuning); only the adapter is synced each step"})
    lora_alpha: float = field(default=0.0, metadata={"help": "LoRA alpha (0 = 2 * lora_rank)"})
    no_progress: bool = field(default=False, metadata={"help": "hide the run-level progress bar (steps, ETA)"})
    engine_process: bool = field(default=False, metadata={"help": "run the engine in its own process "
                                                                  "(RemoteEngine); weights go by CUDA IPC on a GPU, "
                                                                  "by shared memory on the CPU"})

    def __post_init__(self) -> None:
        checks = [
            (self.steps >= 1, f"--steps must be >= 1, got {self.steps}"),
            (self.prompts_per_step >= 1, f"--prompts-per-step must be >= 1, got {self.prompts_per_step}"),
            (self.group_size >= self.MIN_GROUP_SIZE,
             f"--group-size must be >= {self.MIN_GROUP_SIZE} ({self.GROUP_SIZE_WHY}), got {self.group_size}"),
            (self.lr > 0 and math.isfinite(self.lr), f"--lr must be a finite number > 0, got {self.lr}"),
            (self.weight_decay >= 0 and math.isfinite(self.weight_decay),
             f"--weight-decay must be a finite number >= 0, got {self.weight_decay}"),
            (self.eval_every >= 0, f"--eval-every must be >= 0 (0 = off), got {self.eval_every}"),
            (self.task in TASK_NAMES, f"--task must be one of {sorted(TASK_NAMES)}, got {self.task!r}"),
            (self.kl_coef >= 0, f"--kl-coef must be >= 0, got {self.kl_coef}"),
            (0 < self.clip_eps < 1, f"--clip-eps must be in (0, 1), got {self.clip_eps}"),
            (self.tis_cap >= 0, f"--tis-cap must be >= 0 (0 = off), got {self.tis_cap}"),
            (self.updates_per_step >= 1, f"--updates-per-step must be >= 1, got {self.updates_per_step}"),
            (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}"),
            (self.temperature > 0 and math.isfinite(self.temperature),
             f"--temperature must be a finite number > 0 for RL rollouts, got {self.temperature}"),
            (self.device in ("cpu", "cuda"), f"--device must be cpu or cuda, got {self.device!r}"),
            (0 < self.engine_mem_fraction < 1, f"--engine-mem-fraction must be in (0, 1), got {self.engine_mem_fraction}"),
            (self.num_engines >= 1, f"--num-engines must be >= 1, got {self.num_engines}"),
            (self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}"),
            (self.dtype in ("float32", "bfloat16"), f"--dtype must be float32 or bfloat16, got {self.dtype!r}"),
            (not (self.deterministic and self.routing_replay),
             "--deterministic runs the engine's own model code in the trainer, so an MoE policy already routes "
             "every token to the rollout's experts; drop --routing-replay (the two are not combined)"),
            (not (self.deterministic and self.tp_size != 1), "--deterministic needs --tp-size 1"),
            (self.bucket_mb >= 1, f"--bucket-mb must be >= 1, got {self.bucket_mb}"),
            (self.lora_rank >= 0, f"--lora-rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}"),
            (self.lora_alpha >= 0, f"--lora-alpha must be >= 0 (0 = 2 * rank), got {self.lora_alpha}"),
            (not (self.lora_rank and self.deterministic),
             "--deterministic with --lora-rank is not supported: the engine's LoRA matmuls are not batch-invariant"),
            (not (self.engine_process and self.num_engines != 1),
             "--engine-process runs one engine in a child process; with --num-engines > 1 the engines are Ray "
             "actors already: drop one of the two"),
            (not (self.engine_process and self.deterministic),
             "--deterministic reads the engine's model in the trainer's process; it cannot be combined with "
             "--engine-process"),
            (self.full_sync_every >= 0, f"--full-sync-every must be >= 0 (0 = never forced), got {self.full_sync_every}"),
            (self.delta_sync or not self.full_sync_every, "--full-sync-every only applies with --delta-sync"),
            (not (self.delta_sync and self.lora_rank),
             "--delta-sync with --lora-rank: only the adapter is synced already (it is small); drop one of the two"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"--model {self.model!r} is not an HF checkpoint directory (no config.json)")

    # A subclass's own wording for an inherited flag (PPO has no "GRPO group").
    HELP: ClassVar[dict[str, str]] = {}
    # GRPO's advantage is relative to the group's other samples: a group of one has none to compare with.
    MIN_GROUP_SIZE: ClassVar[int] = 2
    GROUP_SIZE_WHY: ClassVar[str] = "GRPO normalizes within a group"

    @classmethod
    def parser(cls, description: str, **defaults) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=description,
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        for f in fields(cls):
            default = defaults.get(f.name, f.default if f.default is not MISSING else None)
            flag = "--" + f.name.replace("_", "-")
            help_ = cls.HELP.get(f.name, f.metadata.get("help"))
            if f.type in ("bool", bool):
                p.add_argument(flag, action="store_true", default=default, help=help_)
            else:
                typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
                p.add_argument(flag, type=typ, default=default, help=help_)
        return p

    @classmethod
    def from_cli(cls, argv=None, description: str = "", **defaults) -> RLConfig:
        args = cls.parser(description, **defaults).parse_args(argv)
        try:
            return cls(**vars(args))
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None


@dataclass
class PPOConfig(RLConfig):
    """RLConfig plus PPO's own knobs: the discount, GAE's lambda, the value head's learning rate and weight."""

    gamma: float = field(default=1.0, metadata={"help": "discount factor of the returns (1 = undiscounted, as "
                                                        "the reward comes once, at the end)"})
    gae_lambda: float = field(default=0.95, metadata={"help": "GAE lambda (0 = one-step TD, 1 = Monte Carlo)"})
    value_lr: float = field(default=0.0, metadata={"help": "AdamW learning rate of the value head (0 = --lr)"})
    vf_coef: float = field(default=0.5, metadata={"help": "weight of the value loss in the total loss"})

    HELP: ClassVar[dict[str, str]] = {
        "group_size": "samples per prompt (G); PPO's advantages come from the value head and GAE, not the group",
        "output_dir": "metrics.jsonl, plot and final checkpoint",
    }
    MIN_GROUP_SIZE: ClassVar[int] = 1  # one sample per prompt is PPO's usual setting: the value head is the baseline
    GROUP_SIZE_WHY: ClassVar[str] = "at least one sample per prompt"

    def __post_init__(self) -> None:
        super().__post_init__()
        for ok, msg in [
            (0 <= self.gamma <= 1, f"--gamma must be in [0, 1], got {self.gamma}"),
            (0 <= self.gae_lambda <= 1, f"--gae-lambda must be in [0, 1], got {self.gae_lambda}"),
            (self.value_lr >= 0, f"--value-lr must be >= 0 (0 = --lr), got {self.value_lr}"),
            (self.vf_coef >= 0, f"--vf-coef must be >= 0, got {self.vf_coef}"),
        ]:
            if not ok:
                raise ValueError(msg)
