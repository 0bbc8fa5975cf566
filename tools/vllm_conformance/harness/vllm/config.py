"""Stub of vllm.config.ModelConfig: the vocabulary size of the demo model served under any name."""

from vllm._served import vocab_size


class ModelConfig:
    def __init__(self, model: str, **kwargs: object) -> None:
        self.model = model

    def get_vocab_size(self) -> int:
        return vocab_size()
