"""A prompt's images (vLLM's `multi_modal_data={"image": ...}`) as the engine takes them: pixel
values made by the checkpoint's own image processor (transformers'), the prompt's image
placeholder tokens expanded to one per image feature, and a hash per image for the prefix cache.

Runs in the client process: the engine core and the workers receive pixel values, never images."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from vllm_lite.config import ModelConfig
from vllm_lite.engine.request_checks import check_pixel_values
from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.wire import ImageInputs

MODALITIES = ("image",)


def check_multi_modal_data(data: Any, model_config: ModelConfig) -> list[Any]:
    """The images of a prompt's `multi_modal_data` (an image or a list of them), refused by name
    where this model takes none or the data is not images."""
    if not isinstance(data, dict):
        raise VLLMValidationError(f"multi_modal_data must be a dict of modality -> data, got {type(data).__name__}",
                                  parameter="multi_modal_data")
    unknown = sorted(str(key) for key, value in data.items() if key not in MODALITIES and value is not None)
    if unknown:
        raise VLLMValidationError(f"multi_modal_data: modalities {unknown} are not implemented (image inputs are)",
                                  parameter="multi_modal_data")
    images = data.get("image")
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    if images and model_config.image_encoder is None:
        raise VLLMValidationError(f"image inputs are not taken by this model: {model_config.images_refused}",
                                  parameter="multi_modal_data")
    if len(images) > model_config.max_images_per_prompt:
        raise VLLMValidationError(f"At most {model_config.max_images_per_prompt} image(s) may be provided in one "
                                  f"prompt, got {len(images)} (limit_mm_per_prompt)", parameter="multi_modal_data")
    from PIL import Image

    for image in images:
        if not isinstance(image, Image.Image):
            raise VLLMValidationError(f"multi_modal_data image must be a PIL.Image.Image, got {type(image).__name__}",
                                      parameter="multi_modal_data")
    return images


class ImageProcessor:
    """The checkpoint's image processor (its preprocessor_config.json), loaded at the first image."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self._processor: Any = None

    def processed(self, images: list[Any]) -> tuple[np.ndarray, np.ndarray | None]:
        """Pixel values as the model's encoder takes them (float32 [n, channels, height, width];
        LLaVA-NeXT's [n, tiles, channels, height, width] with each image's (height, width))."""
        config = self.model_config.image_encoder
        if self._processor is None:
            self._processor = _load_image_processor(self.model_config.model)
        try:
            pixels = self._processor(images=[image.convert("RGB") for image in images], return_tensors="np")
        except (ValueError, OSError) as exc:
            raise VLLMValidationError(f"multi_modal_data: the image could not be processed: {exc}",
                                      parameter="multi_modal_data") from None
        values = np.ascontiguousarray(pixels["pixel_values"], dtype=np.float32)
        sizes = np.asarray(pixels["image_sizes"], dtype=np.int64) if config.any_resolution else None
        if sizes is not None and sizes.tolist() != [[image.height, image.width] for image in images]:
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' read image sizes "
                                      f"{sizes.tolist()} of images of sizes "
                                      f"{[[image.height, image.width] for image in images]}",
                                      parameter="multi_modal_data")
        try:  # (the engine core's own check, run here to name the processor)
            check_pixel_values(values, sizes, len(images), config)
        except VLLMValidationError as exc:
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' made what the vision "
                                      f"encoder cannot take: {exc}", parameter="multi_modal_data") from None
        return values, sizes

    def inputs(self, images: list[Any], token_ids: list[int],
               processed: tuple[np.ndarray, np.ndarray | None] | None = None) -> tuple[list[int], ImageInputs]:
        """The prompt's token ids with each image's placeholder expanded, and its images
        (`processed`: what `processed(images)` gave, where the caller ran it already)."""
        config = self.model_config.image_encoder
        values, sizes = processed if processed is not None else self.processed(images)
        lengths = placeholder_lengths(images, config)
        token_ids, offsets = expand_placeholders(token_ids, lengths, config.image_token_id)
        hashes = [hashlib.sha256(np.ascontiguousarray(value).tobytes()
                                 + (sizes[i].tobytes() if sizes is not None else b"")).digest()
                  for i, value in enumerate(values)]
        return token_ids, ImageInputs(values, offsets, lengths, hashes, sizes)


def placeholder_lengths(images: list[Any], config: Any) -> np.ndarray:
    """Each (PIL) image's placeholder tokens: one per feature it becomes (vision_config.py)."""
    return np.array([config.tokens_for(image.height, image.width) for image in images], dtype=np.int64)


def expand_placeholders(token_ids: list[int], lengths: np.ndarray, image_token_id: int) -> tuple[list[int], np.ndarray]:
    """Each image's placeholder token (as a chat template writes it) made lengths[i] tokens, as
    transformers' processor expands it; a prompt already expanded (a run of lengths[i] per image)
    is taken as it is. Returns the token ids and each image's first placeholder position."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    positions = np.flatnonzero(tokens == image_token_id)
    if len(positions) == len(lengths):
        repeats = np.ones(len(tokens), dtype=np.int64)
        repeats[positions] = lengths
        offsets = positions + np.concatenate([[0], np.cumsum(lengths - 1)[:-1]])
        return np.repeat(tokens, repeats).tolist(), offsets.astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if len(positions) == bounds[-1]:
        starts = positions[bounds[:-1]]
        if np.array_equal(positions, np.concatenate([start + np.arange(n) for start, n in zip(starts, lengths)])):
            return list(token_ids), starts.astype(np.int64)
    raise VLLMValidationError(f"the prompt holds {len(positions)} image placeholder tokens (id {image_token_id}) for "
                              f"{len(lengths)} image(s): give one per image (the model's chat template writes it), "
                              f"or each image's {', '.join(map(str, lengths.tolist()))} in a row",
                              parameter="multi_modal_data")


def _load_image_processor(model: str) -> Any:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise VLLMValidationError(f"image inputs need the checkpoint's image processor "
                                  f"(preprocessor_config.json in '{model}'): {exc}",
                                  parameter="multi_modal_data") from None
