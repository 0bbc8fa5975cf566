"""LoRA adapters (vLLM's `vllm.lora`): the request that names one (`request.LoRARequest`) and the
reading of a PEFT adapter folder (`peft`). The layers apply them in model/layers/lora.py; each
worker keeps the adapters its batch uses (worker/lora_manager.py)."""
