"""rollout: requests. The Engine (SGLang-compatible public API), the scheduler with continuous
batching, chunked prefill and retraction, the prefix cache, sampling params and tokenization."""

from rollout.engine import Engine
from rollout.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]
