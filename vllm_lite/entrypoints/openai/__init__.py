"""The OpenAI-compatible HTTP server (`vllm-lite serve`)."""
