"""Tensor parallelism: `create_model_runner(config)` gives a ModelRunner for tp_size=1 and a
TPModelRunner (rank 0 here, ranks 1..N-1 in child processes; runner/tp/runner.py) for tp_size > 1."""

from __future__ import annotations

from runner.config import ModelConfig, RunnerConfig, check_tp_size


def create_model_runner(config: RunnerConfig):
    if config.tp_size == 1:
        from runner.model_runner import ModelRunner

        return ModelRunner(config)
    check_tp_size(ModelConfig.from_pretrained(config.model_path), config.tp_size)
    from runner.tp.runner import TPModelRunner

    return TPModelRunner(config)
