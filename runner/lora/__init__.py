"""LoRA: PEFT adapters served beside the base model, many adapters (and the base) in one batch.

    config.py    SGLang's LoRA options (lora_paths forms, target modules) and PEFT's adapter_config.json
    options.py   RunnerConfig's LoRA fields validated and completed before anything is built
    adapter.py   PEFT tensors -> per-module slot buffers, every check done before anything is written
    layer.py     one adapted projection: slot buffers, the masked and segmented LoRA matmuls
    manager.py   LoRAManager: loaded adapters, their device slots, each step's rows grouped by adapter

Tensor-parallel ranks each hold their slice of every adapter (layer.py); rank 0 loads through all of
them (runner/tp/). Requests, the prefix cache namespaces and waiting for requests before an unload are rollout's.
"""
