"""runner: tensors and memory on one device. It knows nothing of requests; `rollout` builds on it.

The folders follow the parts of the ModelRunner diagram:

                          +----------------------------+
                          | ModelRunner (model_runner) |  init order, forward dispatch, sample
                          +----------------------------+
      +------------+-----------+-------------+-----------+-------------+--------------+
      |            |           |             |           |             |              |
    model     memory pool  graph runner  attention    sampler     LoRA manager     weights
   models/     memory/      graphs/      attention/  sampler.py   (lora/, to come)  weights/
   layers/   kv_pool.py    graph_runner  torch_native              checkpoint.py
             memory_saver  cuda_graph_.. flashinfer                loader.py
             occupation    cpu_graph_..                            routes.py
                                                                   update_groups.py

layers/ holds the building blocks the models share, with layers/ops.py (the opaque ops a captured CPU
step calls) below both layers and graphs. tp/ runs the same ModelRunner over tensor-parallel ranks.
config.py, forward_batch.py, batch_invariant.py (deterministic kernels) and expert_distribution.py
(MoE routing records) are shared by all parts. No module imports one that imports it back
(tests/runner/test_layout.py).
"""

from runner.config import ModelConfig, RunnerConfig
from runner.forward_batch import ForwardBatch, ForwardMode, LogitsOutput
from runner.model_runner import ModelRunner

__all__ = ["ForwardBatch", "ForwardMode", "LogitsOutput", "ModelConfig", "ModelRunner", "RunnerConfig"]
