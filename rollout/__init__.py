"""rollout: requests. The Engine (SGLang-compatible public API), the scheduler with continuous
batching, chunked prefill and retraction, the prefix cache, sampling params and tokenization.

Importing it before torch, in an environment that chose no libgomp wait (GOMP_SPINCOUNT, OMP_WAIT_POLICY),
sets GOMP_SPINCOUNT=10000 for this process, as the engine's own child processes get (runner/omp_env.py says
why: the default spin costs a 2-thread step several times its time when the machine is shared). Imported
after torch it changes nothing: libgomp read its settings when torch loaded.
"""

import os as _os
import sys as _sys

# Before anything imports torch (runner's package does): runner.omp_env.CHILD_SPINCOUNT and USER_CHOICES.
if "torch" not in _sys.modules and not any(k in _os.environ for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")):
    _os.environ["GOMP_SPINCOUNT"] = "10000"

from rollout.engine import Engine  # noqa: E402
from rollout.sampling_params import SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams"]
