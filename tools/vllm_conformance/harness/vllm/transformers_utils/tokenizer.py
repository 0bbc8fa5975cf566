"""Older spelling of vllm.tokenizers.get_tokenizer."""

from vllm.tokenizers import get_tokenizer

__all__ = ["get_tokenizer"]
