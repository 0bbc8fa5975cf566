"""Stub of the few `vllm` modules vLLM's OpenAI-server tests import for helpers (tokenizer,
vocabulary size, version): each answers for the server under test, on the demo model.
Part of the conformance harness (tools/vllm_conformance), not of vllm_lite."""
