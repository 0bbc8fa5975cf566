"""A prompt's images (vLLM's `multi_modal_data={"image": ...}`) as the engine takes them: pixel
values made by the checkpoint's own image processor (transformers'), the prompt's image
placeholder tokens expanded to one per image feature, and a hash per image for the prefix cache.

Runs in the client process: the engine core and the workers receive pixel values, never images."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from vllm_lite.config import ModelConfig
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

    def pixel_values(self, images: list[Any]) -> np.ndarray:
        """float32 [n, channels, height, width] as the model's encoder takes them."""
        config = self.model_config.image_encoder
        if self._processor is None:
            self._processor = _load_image_processor(self.model_config.model)
        try:
            pixels = self._processor(images=[image.convert("RGB") for image in images], return_tensors="np")
        except (ValueError, OSError) as exc:
            raise VLLMValidationError(f"multi_modal_data: the image could not be processed: {exc}",
                                      parameter="multi_modal_data") from None
        values = np.ascontiguousarray(pixels["pixel_values"], dtype=np.float32)
        expected = (len(images), config.num_channels, config.image_size, config.image_size)
        if values.shape != expected:
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' made pixel values of shape "
                                      f"{values.shape}; the vision encoder takes {expected}",
                                      parameter="multi_modal_data")
        return values

    def inputs(self, images: list[Any], token_ids: list[int]) -> tuple[list[int], ImageInputs]:
        """The prompt's token ids with each image's placeholder expanded, and its images."""
        config = self.model_config.image_encoder
        token_ids, offsets = expand_placeholders(token_ids, len(images), config.image_token_id,
                                                 config.tokens_per_image)
        values = self.pixel_values(images)
        hashes = [hashlib.sha256(np.ascontiguousarray(value).tobytes()).digest() for value in values]
        return token_ids, ImageInputs(values, offsets, config.tokens_per_image, hashes)


def expand_placeholders(token_ids: list[int], num_images: int, image_token_id: int,
                        tokens_per_image: int) -> tuple[list[int], np.ndarray]:
    """Each image's placeholder token (as a chat template writes it) made `tokens_per_image`
    tokens, as transformers' processor expands it; a prompt already expanded (a run of
    `tokens_per_image` per image) is taken as it is. Returns the token ids and each image's
    first placeholder position."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    positions = np.flatnonzero(tokens == image_token_id)
    if len(positions) == num_images:
        expanded = np.repeat(tokens, np.where(tokens == image_token_id, tokens_per_image, 1))
        offsets = positions + np.arange(num_images) * (tokens_per_image - 1)
        return expanded.tolist(), offsets.astype(np.int64)
    starts = positions[::tokens_per_image]
    runs = (len(positions) == num_images * tokens_per_image
            and np.array_equal(positions, (starts[:, None] + np.arange(tokens_per_image)).ravel()))
    if runs:
        return list(token_ids), starts.astype(np.int64)
    raise VLLMValidationError(f"the prompt holds {len(positions)} image placeholder tokens (id {image_token_id}) for "
                              f"{num_images} image(s): give one per image (the model's chat template writes it), "
                              f"or {tokens_per_image} in a row per image", parameter="multi_modal_data")


def _load_image_processor(model: str) -> Any:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise VLLMValidationError(f"image inputs need the checkpoint's image processor "
                                  f"(preprocessor_config.json in '{model}'): {exc}",
                                  parameter="multi_modal_data") from None
