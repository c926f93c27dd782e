"""runner: tensors and memory. ModelRunner, models, layers, attention backends, KV pool, sampler,
weight loading and the memory saver. It knows nothing of requests; `rollout` builds on it."""

from runner.config import ModelConfig, RunnerConfig
from runner.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
from runner.model_runner import ModelRunner

__all__ = ["ForwardBatch", "ForwardMode", "LogitsOutput", "ModelConfig", "ModelRunner", "RunnerConfig"]
