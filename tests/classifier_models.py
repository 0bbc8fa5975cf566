"""Tiny `*ForSequenceClassification` checkpoints (random weights, saved by transformers) and
transformers' own outputs for them: the reference the pooling runner's classify task is held to."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_classifier(base: Path, out: Path, num_labels: int, seed: int = 0, **config_changes) -> Path:
    """A `*ForSequenceClassification` of `base`'s architecture and size, `num_labels` labels
    (named by id2label), its head drawn at random (scaled so the classes differ)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(base)
    config.num_labels = num_labels
    config.id2label = {i: f"class_{chr(97 + i)}" for i in range(num_labels)}
    config.label2id = {label: i for i, label in config.id2label.items()}
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    for key, value in config_changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


@functools.lru_cache(maxsize=4)
def _model(folder: str):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_class_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits [num_labels] for one prompt (batch 1: no padding)."""
    return _model(str(folder))(input_ids=torch.tensor([token_ids])).logits[0].float()
