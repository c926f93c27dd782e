"""Step logging: a console line, `metrics.jsonl` (one JSON object per step), wandb, and a PNG of
the reward and logprob-mismatch curves at the end.

wandb runs offline unless the user configured it (WANDB_API_KEY or WANDB_MODE); it is imported
lazily and its absence only disables that sink. Does not aggregate across processes.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from tqdm import tqdm

ZERO_FLOOR = 1e-12  # where an exact-zero mismatch is drawn on the log axis (log(0) has no place)


def mismatch_series(values: list[float]) -> tuple[list[float], str | None]:
    """The mismatch curve for a log axis: zeros lifted to ZERO_FLOOR, and the legend note saying so
    (None when no value is exactly 0)."""
    zeros = sum(1 for v in values if v == 0)
    note = (f"exactly 0 at {zeros} of {len(values)} step(s) (drawn at {ZERO_FLOOR:g})" if zeros else None)
    return [max(v, ZERO_FLOOR) for v in values], note


class MetricsLogger:
    def __init__(self, output_dir: str | Path, config: dict, use_wandb: bool, project: str) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.output_dir / "metrics.jsonl", "w")
        self.history: list[dict] = []
        self.initial_eval: float | None = None  # greedy eval before step 1, plotted at step 0
        self.wandb_run = None
        if use_wandb:
            try:
                import wandb

                mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
                # reinit="finish_previous": a second run in one process (tests, sweeps) ends the first;
                # the boolean spelling is deprecated in wandb >= 0.19 and warns.
                self.wandb_run = wandb.init(project=project, config=config, mode=mode,
                                            dir=str(self.output_dir), reinit="finish_previous")
            except Exception as e:  # an optional sink must not stop training
                print(f"[metrics] wandb disabled: {type(e).__name__}: {e}")

    def log(self, metrics: dict) -> None:
        clean = {k: (float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v)
                 for k, v in metrics.items()}
        clean["step"] = int(metrics["step"])
        self.history.append(clean)
        self.jsonl.write(json.dumps(clean) + "\n")
        self.jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(clean, step=clean["step"])
        tqdm.write(self.console_line(clean), file=sys.stdout)  # above the run's progress bar, if any
        sys.stdout.flush()

    @staticmethod
    def console_line(m: dict) -> str:
        parts = [f"step {m['step']:3d}", f"reward {m['reward_mean']:.3f}"]
        if "eval_accuracy" in m:
            parts.append(f"eval {m['eval_accuracy']:.3f}")
        parts += [f"mismatch {m['logprob_mismatch']:.2e}", f"loss {m['loss']:+.4f}"]
        if "value_loss" in m:  # PPO
            parts.append(f"value_loss {m['value_loss']:.4f}")
        parts += [
                  f"rollout {m['time_rollout']:.2f}s", f"train {m['time_train']:.2f}s",
                  f"release {m['time_release'] * 1e3:.0f}ms", f"resume {m['time_resume'] * 1e3:.0f}ms",
                  f"sync {m['time_sync'] * 1e3:.0f}ms"
                  + (f" {m['sync_bytes'] / 2**20:.2f}/{m['sync_bytes_full'] / 2**20:.2f}MB" if "sync_bytes" in m else ""),
                  f"mem engine {m['mem_engine_rollout'] / 2**20:.0f}->{m['mem_engine_train'] / 2**20:.0f}MB",
                  f"trainer {m['mem_trainer_rollout'] / 2**20:.0f}/{m['mem_trainer_train'] / 2**20:.0f}MB"]
        return " | ".join(parts)

    def plot(self) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("[metrics] matplotlib not installed: no plot")
            return None
        steps = [m["step"] for m in self.history]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(steps, [m["reward_mean"] for m in self.history], label="rollout reward")
        evals = [(0, self.initial_eval)] if self.initial_eval is not None else []
        evals += [(m["step"], m["eval_accuracy"]) for m in self.history if "eval_accuracy" in m]
        if evals:
            ax1.plot(*zip(*evals), "o-", label="greedy eval accuracy")
        ax1.set_xlabel("step")
        ax1.set_ylim(0, 1.05)
        ax1.legend()
        ax1.set_title("reward")
        mism, zero_note = mismatch_series([m["logprob_mismatch"] for m in self.history])
        ax2.plot(steps, mism, label="mismatch")
        ax2.set_yscale("log" if all(math.isfinite(x) for x in mism) else "linear")
        if zero_note:
            zeros = [s for s, m in zip(steps, self.history) if m["logprob_mismatch"] == 0]
            ax2.plot(zeros, [ZERO_FLOOR] * len(zeros), "v", color="tab:green", label=zero_note)
            ax2.legend()
        ax2.set_xlabel("step")
        ax2.set_title("mean |logp_rollout - logp_trainer|")
        fig.tight_layout()
        path = self.output_dir / "curves.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        self.jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
