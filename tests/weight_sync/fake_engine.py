"""A model-free engine for RemoteEngine protocol tests: answers are functions of the arguments, so a
reply can be checked against the call that asked for it, and start-up can be made to fail."""

from __future__ import annotations

import os
import time


class EchoEngine:
    """`get_weights_by_name(name)` -> [pid, name] after `delay_s`; `get_server_info()` -> a generator
    (a result JSON cannot carry); `generate(...)` -> the prompt reversed; `update_weights_from_tensor` -> what
    it was given."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    def get_weights_by_name(self, name: str, truncate_size: int = 100):
        time.sleep(self.delay_s)
        return [os.getpid(), name]

    def get_server_info(self):
        return (i for i in range(3))

    def generate(self, prompt: str = "", **kwargs):
        return {"text": prompt[::-1]}

    def update_weights_from_tensor(self, named_tensors, **kwargs):
        """-> (True, what arrived): the keyword arguments and each (name, values) of the bucket, as JSON."""
        import json

        tensors = [[n, t.flatten().tolist()] for n, t in named_tensors.named_tensors()]
        return True, json.dumps({"kwargs": kwargs, "tensors": tensors}, sort_keys=True)

    def shutdown(self) -> None:
        pass


def failing_engine(**kwargs):
    raise ValueError(f"refusing to start with {sorted(kwargs)}")


def dying_engine(**kwargs):
    os._exit(3)  # dies without a word: the parent must notice the exit
