"""Stub of vllm.tokenizers.get_tokenizer: the tokenizer of the demo model served under any name."""

from transformers import AutoTokenizer

from vllm._served import model_dir


def get_tokenizer(tokenizer_name: str | None = None, *args: object, **kwargs: object):
    return AutoTokenizer.from_pretrained(model_dir())
