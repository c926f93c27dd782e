"""The `rl_on_policy_target="fsdp"` switch: follow transformers' op order and dtypes in the forward.

Set per thread for the duration of a forward (like runner/batch_invariant.py's mode). What changes
when on: attention is the per-request SDPA of runner/attention/hf_sdpa.py (chosen at init by
RunnerConfig), and the MLP activation runs on contiguous gate/up halves as HF's separate gate_proj
and up_proj outputs are (torch's elementwise kernels may round a strided view differently). The
norms, rotary, residual adds and the LM head already compute as HF's Llama/Qwen2 modules do (fp32
RMSNorm cast back before the weight, bf16 rotary, bf16 logits then fp32 log-softmax); prepacked and
captured kernels are turned off by RunnerConfig. The default path is untouched.
"""

from __future__ import annotations

from runner.thread_flag import ThreadFlag

# Per thread (each engine's scheduler thread, the forward worker, the trainer's thread): `with mode():`.
_flag = ThreadFlag()
is_enabled = _flag.is_enabled
mode = _flag.mode
