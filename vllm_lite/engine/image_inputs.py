"""A prompt's images (vLLM's `multi_modal_data={"image": ...}`) as the engine takes them: pixel
values made by the checkpoint's own image processor (transformers'), the prompt's image
placeholder tokens expanded to one per image feature, and a hash per image for the prefix cache.

Runs in the client process: the engine core and the workers receive pixel values, never images."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from vllm_lite.config import ModelConfig
from vllm_lite.engine.request_checks import check_patches, check_pixel_values, check_whole_images
from vllm_lite.exceptions import VLLMValidationError
from vllm_lite.sized_lru import SizedLru
from vllm_lite.vision_config import check_processor_kwargs
from vllm_lite.wire import ImageInputs

MODALITIES = ("image",)


def check_multi_modal_data(data: Any, model_config: ModelConfig,
                           uuids: Any = None) -> tuple[list[Any], list[str | None]]:
    """The images of a prompt's `multi_modal_data` (an image or a list of them) and their vLLM
    `multi_modal_uuids` (None: identified by content), refused by name where this model takes
    none or the data is not images. An image may be None where its uuid names one processed before."""
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
    image_uuids = _image_uuids(uuids, len(images))
    from PIL import Image

    for image, uuid in zip(images, image_uuids):
        if not isinstance(image, Image.Image) and not (image is None and uuid is not None):
            raise VLLMValidationError(f"multi_modal_data image must be a PIL.Image.Image, got {type(image).__name__} "
                                      f"(None only where multi_modal_uuids names the image)",
                                      parameter="multi_modal_data")
    return images, image_uuids


def _image_uuids(uuids: Any, count: int) -> list[str | None]:
    """vLLM's multi_modal_uuids for a prompt's `count` images: {"image": uuid or [uuid or None, ...]}."""
    if uuids is None:
        return [None] * count
    if not isinstance(uuids, dict) or any(key not in MODALITIES for key in uuids):
        raise VLLMValidationError(f"multi_modal_uuids must be a dict with the key 'image' (the one modality taken "
                                  f"here), got {uuids!r:.200}", parameter="multi_modal_uuids")
    given = uuids.get("image")
    given = [given] if isinstance(given, str) or given is None else given
    if not (isinstance(given, (list, tuple)) and len(given) == count
            and all(uuid is None or isinstance(uuid, str) and uuid for uuid in given)):
        raise VLLMValidationError(f"multi_modal_uuids['image'] must give a non-empty string or None for each of the "
                                  f"prompt's {count} image(s), got {uuids.get('image')!r:.200}",
                                  parameter="multi_modal_uuids")
    return list(given)


class ProcessedImage(NamedTuple):
    """One image as the vision encoder takes it."""

    # float32 [channels, height, width]; LLaVA-NeXT, SmolVLM, InternVL: [tiles, channels, height, width];
    # Qwen2-VL: [patches, values of a patch]
    pixel_values: np.ndarray
    size: tuple[int, int]  # the image's (height, width)
    # SHA-256 of the pixel values (LLaVA-NeXT: and the size; SmolVLM, Qwen2-VL: and the grid): the
    # prefix and encoder caches' key
    digest: bytes
    # Idefics3 / SmolVLM: the (rows, columns) of tiles its processor cut (0, 0: the whole image
    # only); its tiles, then the whole image, are its encoder inputs. Qwen2-VL: its (rows,
    # columns) of patches. Mistral 3: its (rows, columns) of features
    grid: tuple[int, int] = (0, 0)


class ImageProcessor:
    """The checkpoint's image processor (its preprocessor_config.json), loaded at the first image.
    An image processed before is taken from a cache by its content (vLLM's processor cache,
    `mm_processor_cache_gb`), skipping the processor and the hashing of its pixel values."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        self.model_config = model_config
        self._processor: Any = None
        self._class_defaults: dict[str, Any] = {}  # (read with the processor: _processor_class_defaults)
        self._placeholders = PlaceholderExpansion(model_config.image_encoder, tokenizer)
        self._cache: SizedLru[ProcessedImage] = SizedLru(model_config.mm_processor_cache_bytes,
                                                         lambda image: image.pixel_values.nbytes)
        self._cache_lock = threading.Lock()  # (AsyncLLM processes prompts' images on worker threads)
        self.cache_queries = 0  # (vLLM's vllm:mm_cache_queries / _hits: images looked up, images found)
        self.cache_hits = 0
        if model_config.image_encoder is not None and model_config.mm_processor_kwargs:
            self._check_engine_kwargs()

    def _check_engine_kwargs(self) -> None:
        """The engine's mm_processor_kwargs tried at start on a small image (not kept), so that one
        the processor does not take is refused when the engine starts, not at its first image."""
        from PIL import Image

        try:
            self._process([Image.new("RGB", (64, 48), (127, 127, 127))], dict(self.model_config.mm_processor_kwargs))
        except VLLMValidationError as exc:
            raise ValueError(f"mm_processor_kwargs={self.model_config.mm_processor_kwargs!r}: {exc}") from None

    def processed(self, images: list[Any], uuids: list[str | None],
                  kwargs: Mapping[str, Any] | None = None) -> list[ProcessedImage]:
        """Each image processed (with the engine's mm_processor_kwargs, and the request's
        `kwargs` over them), or taken from the cache by its uuid or its content and those
        arguments (an image given as None: by its uuid, which must be there)."""
        kwargs = self._merged_kwargs(kwargs)
        whole = self.model_config.image_encoder.whole_only(len(images) == 1)
        arguments = self._arguments(kwargs, whole)
        rgb = [image.convert("RGB") if image is not None else None for image in images]
        keys = [_uuid_key(uuid, arguments) if uuid is not None
                else _content_key(image, arguments) if self._cache.budget else None
                for image, uuid in zip(rgb, uuids)]
        with self._cache_lock:
            found = [self._cache.get(key) if key is not None else None for key in keys]
            self.cache_queries += sum(key is not None for key in keys)
            self.cache_hits += sum(image is not None for image in found)
        missing = [i for i, image in enumerate(found) if image is None and rgb[i] is not None]
        if missing:
            made = self._process([rgb[i] for i in missing], kwargs, whole)
            with self._cache_lock:
                for i, image in zip(missing, made):
                    if uuids[i] is not None:  # (vLLM's: the uuid identifies the image in the caches)
                        image = image._replace(digest=_uuid_key(uuids[i], arguments))
                    found[i] = image
                    if keys[i] is not None:
                        self._cache.put(keys[i], image)
        made_here = {keys[i]: found[i] for i in missing}
        for i, uuid in enumerate(uuids):
            if found[i] is None:  # (an image given as None; its id may name an image earlier in the prompt)
                found[i] = made_here.get(keys[i])
            if found[i] is None:
                raise _not_kept(i, uuid)
        return found

    def sizes(self, images: list[Any], uuids: list[str | None],
              kwargs: Mapping[str, Any] | None = None) -> list[tuple[int, int]]:
        """Each image's (height, width); an image given as None: that of the image its uuid names
        (earlier in the prompt, or processed before with these processor arguments)."""
        whole = self.model_config.image_encoder.whole_only(len(images) == 1)
        arguments = self._arguments(self._merged_kwargs(kwargs), whole)
        given = {uuid: (image.height, image.width) for image, uuid in zip(images, uuids) if image is not None}
        sizes = []
        for i, (image, uuid) in enumerate(zip(images, uuids)):
            if image is not None:
                sizes.append((image.height, image.width))
                continue
            with self._cache_lock:
                kept = self._cache.get(_uuid_key(uuid, arguments))
            if kept is None and uuid not in given:
                raise _not_kept(i, uuid)
            sizes.append(kept.size if kept is not None else given[uuid])
        return sizes

    def expanded(self, token_ids: list[int], images: list[Any], uuids: list[str | None],
                 kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt's token ids with each image's placeholder expanded, before its images are
        processed where their count allows (what the server checks the prompt's length on)."""
        config = self.model_config.image_encoder
        if config.tiled:  # (its tiles depend on the processor's resize: process)
            return self._placeholders.expand_tiled(token_ids, self.processed(images, uuids, kwargs))[0]
        if config.row_breaks:  # (so do its features)
            return self._placeholders.expand_rows(token_ids, [image.grid for image in self.processed(images, uuids, kwargs)])[0]
        if config.framed:  # (Gemma 3: its pan-and-scan crops depend on the image: process when asked for)
            crops = ([len(image.pixel_values) - 1 for image in self.processed(images, uuids, kwargs)]
                     if self._pans_and_scans(self._merged_kwargs(kwargs)) else [0] * len(images))
            return self._placeholders.expand_framed(token_ids, crops)[0]
        if config.mrope:  # (so do its patches)
            return self._placeholders.expand(token_ids, _patch_lengths(self.processed(images, uuids, kwargs), config))[0]
        lengths = placeholder_lengths(self.sizes(images, uuids, kwargs), config)
        return self._placeholders.expand(token_ids, lengths)[0]

    def reset_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()

    @staticmethod
    def _arguments(kwargs: dict[str, Any], whole: bool) -> bytes:
        """What an image's cache keys hold besides it: its processor arguments, and (LLaVA-OneVision)
        whether it is read whole only."""
        return _arguments_key(kwargs) + (b"\0read whole only" if whole else b"")

    def _check_bounds(self, kwargs: dict[str, Any]) -> None:
        """mm_processor_kwargs that would have the processor make more of an image than a prompt
        of max_model_len tokens holds, refused before it runs (it builds the pixels first: an
        upscale to a huge size or thousands of tiles or crops would exhaust this process's
        memory): counts of tiles or crops, edges in pixels, Qwen's least pixels, LLaVA-NeXT's grid
        pinpoints; bounds from the encoder's input and max_model_len. (Mistral 3's processor only
        ever scales an image down: its sizes are bounded by the image itself.)"""
        config, limit = self.model_config.image_encoder, self.model_config.max_model_len
        if config.row_breaks:
            return
        inputs = max(1, limit // max(1, config.tokens_per_image))  # (tiles or crops: encoder inputs)
        unit = config.feature_pixels if config.mrope else config.image_size
        most_edge = unit * math.isqrt(limit if config.mrope else inputs) + unit

        def refuse(name: str, value: Any, bound: int) -> VLLMValidationError:
            return VLLMValidationError(f"mm_processor_kwargs: {name}={value!r} would make more of an image than a "
                                       f"prompt of max_model_len={limit} tokens holds (at most {bound})",
                                       parameter="mm_processor_kwargs")

        for name in ("max_patches", "min_patches", "pan_and_scan_max_num_crops"):
            if _number(kwargs.get(name)) > inputs:
                raise refuse(name, kwargs[name], inputs)
        for name, value in kwargs.items():
            for key, number in _size_fields(name, value):
                least_area = config.mrope and key in ("min_pixels", "shortest_edge")  # (Qwen's: pixels)
                if least_area and number > limit * unit * unit:
                    raise refuse(name, value, limit * unit * unit)
                if not config.mrope and key in _EDGE_KEYS and number > most_edge:
                    raise refuse(name, value, most_edge)
        if config.tiled and not config.tile_frame and {"size", "max_image_size"} & set(kwargs):
            # (SmolVLM: tiles of max_image_size across an image resized to size: their count)
            longest, tile = (_longest_edge(kwargs.get(name) or getattr(self._processor, name, None))
                             for name in ("size", "max_image_size"))
            if tile <= 0 or math.ceil(longest / tile) ** 2 > inputs:
                raise refuse("max_image_size", kwargs.get("max_image_size"), inputs)
        pinpoints = kwargs.get("image_grid_pinpoints")
        for pinpoint in pinpoints if isinstance(pinpoints, (list, tuple)) else ():
            if isinstance(pinpoint, (list, tuple)) and math.prod(map(_number, pinpoint)) > inputs * config.image_size ** 2:
                raise refuse("image_grid_pinpoints", kwargs["image_grid_pinpoints"], inputs)

    def _refused_kwargs(self, kwargs: dict[str, Any], exc: Exception) -> VLLMValidationError:
        return VLLMValidationError(f"mm_processor_kwargs {sorted(kwargs)}: the image processor of "
                                   f"'{self.model_config.model}' does not take them: {exc}",
                                   parameter="mm_processor_kwargs")

    def _pans_and_scans(self, kwargs: dict[str, Any]) -> bool:
        """Gemma 3: whether its processor cuts crops (vLLM's do_pan_and_scan in mm_processor_kwargs;
        its processor class passes False by default, whatever its image processor's config says)."""
        self._loaded_processor()
        arguments = self._processor_arguments(kwargs)
        return bool(arguments.get("do_pan_and_scan", getattr(self._processor, "do_pan_and_scan", False)))

    def _loaded_processor(self) -> Any:
        if self._processor is None:
            self._processor = _load_image_processor(self.model_config.model)
            self._class_defaults = _processor_class_defaults(self.model_config.model)
        return self._processor

    def _merged_kwargs(self, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
        """The engine's mm_processor_kwargs with a request's over them."""
        return {**(self.model_config.mm_processor_kwargs or {}), **(request_processor_kwargs(kwargs) or {})}

    def _process(self, images: list[Any], kwargs: dict[str, Any], whole: bool = False) -> list[ProcessedImage]:
        """RGB images through the checkpoint's processor (with `kwargs`), each image's own tiles
        kept (`whole`: LLaVA-OneVision's images of a prompt with several, read whole only)."""
        config = self.model_config.image_encoder
        self._loaded_processor()
        self._check_bounds(kwargs)
        try:
            arguments = self._processor_arguments(kwargs)
            if config.row_breaks:  # (Mistral 3: sizes in whole features, as its processor asks)
                unit = config.feature_pixels
                pixels = self._processor(images=images, return_tensors="np",
                                         **{"patch_size": {"height": unit, "width": unit}, **arguments})
            elif config.tiled and not config.tile_frame:  # (SmolVLM: one sample per image, its tiles in a row)
                pixels = self._processor(images=[[image] for image in images], return_tensors="np",
                                         **{"return_row_col_info": True, **arguments})
            else:
                pixels = self._processor(images=self._batch(images, whole), return_tensors="np", **arguments)
        except VLLMValidationError:
            raise
        except (ValueError, OSError) as exc:
            if not kwargs or isinstance(exc, OSError):
                raise VLLMValidationError(f"multi_modal_data: the image could not be processed: {exc}",
                                          parameter="multi_modal_data") from None
            raise self._refused_kwargs(kwargs, exc) from None
        except Exception as exc:  # (transformers' processors refuse arguments with TypeError and others)
            raise self._refused_kwargs(kwargs, exc) from None
        values = np.ascontiguousarray(pixels["pixel_values"], dtype=np.float32)
        if config.tile_frame:
            return self._image_inputs(images, values, np.asarray(pixels["num_patches"], dtype=np.int64))
        if config.row_breaks:
            return self._whole_images(images, values, np.asarray(pixels["image_sizes"], dtype=np.int64))
        if config.framed:  # (Gemma 3: each image, then its pan-and-scan crops)
            return self._image_inputs(images, values, 1 + np.asarray(pixels.get("num_crops", [0] * len(images)),
                                                                     dtype=np.int64))
        if config.tiled:
            return self._tiles(images, values, pixels)
        if config.mrope:
            return self._patches(images, values, np.asarray(pixels["image_grid_thw"], dtype=np.int64))
        sizes = np.asarray(pixels["image_sizes"], dtype=np.int64)[:len(images)] if config.any_resolution else None
        if sizes is not None and sizes.tolist() != [[image.height, image.width] for image in images]:
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' read image sizes "
                                      f"{sizes.tolist()} of images of sizes "
                                      f"{[[image.height, image.width] for image in images]}",
                                      parameter="multi_modal_data")
        self._check_made(check_pixel_values, values[:len(images)], sizes, len(images), config, not whole)
        made = []
        for i, image in enumerate(images):
            own = (values[i, :config.tiles_for(image.height, image.width, alone=not whole)] if config.any_resolution
                   else values[i])
            own = own.copy()  # (not a view: a kept image would keep the whole batch)
            size = (image.height, image.width)
            digest = hashlib.sha256(own.tobytes() + (np.array(size, np.int64).tobytes() if config.any_resolution
                                                     else b"")).digest()
            made.append(ProcessedImage(own, size, digest))
        return made

    def _tiles(self, images: list[Any], values: np.ndarray, pixels: Any) -> list[ProcessedImage]:
        """Idefics3 / SmolVLM: each image's tiles and whole image (the processor pads a batch with
        all-zero tiles, left out), each read by the encoder unpadded."""
        config, made = self.model_config.image_encoder, []
        for i, image in enumerate(images):
            grid = (int(pixels["rows"][i][0]), int(pixels["cols"][i][0]))
            count = tile_inputs(grid)
            own = values[i, :count].copy()  # (not a view: a kept image would keep the whole batch)
            if not np.asarray(pixels["pixel_attention_mask"][i, :count]).all():
                raise VLLMValidationError(f"the image processor of '{self.model_config.model}' padded a tile of an "
                                          f"image of size {image.height} x {image.width} (its encoder's partly "
                                          "padded inputs are not implemented: keep do_image_splitting on)",
                                          parameter="multi_modal_data")
            self._check_made(check_pixel_values, own, None, count, config)
            digest = hashlib.sha256(own.tobytes() + np.array(grid, np.int64).tobytes()).digest()
            made.append(ProcessedImage(own, (image.height, image.width), digest, grid))
        return made

    def _image_inputs(self, images: list[Any], values: np.ndarray, counts: np.ndarray) -> list[ProcessedImage]:
        """InternVL's tiles, Gemma 3's image and crops: each image's encoder inputs (the processor
        gives the batch's in one run, and each image's count)."""
        if counts.shape != (len(images),) or counts.min(initial=1) < 1 or counts.sum() != len(values):
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' made {len(values)} tiles "
                                      f"counted {counts.tolist()} for {len(images)} image(s)",
                                      parameter="multi_modal_data")
        made = []
        for image, own in zip(images, np.split(values, np.cumsum(counts)[:-1])):
            own = own.copy()  # (not a view: a kept image would keep the whole batch)
            self._check_made(check_pixel_values, own, None, len(own), self.model_config.image_encoder)
            made.append(ProcessedImage(own, (image.height, image.width), hashlib.sha256(own.tobytes()).digest()))
        return made

    def _whole_images(self, images: list[Any], values: np.ndarray, sizes: np.ndarray) -> list[ProcessedImage]:
        """Mistral 3: each image resized by the processor (the batch zero-padded to the largest),
        cut to its size, and its grid of features."""
        config, made = self.model_config.image_encoder, []
        if sizes.shape != (len(images), 2) or values.shape[0] != len(images):
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' made sizes "
                                      f"{sizes.tolist()} for {len(images)} image(s)", parameter="multi_modal_data")
        for image, own, size in zip(images, values, sizes):
            height, width = size.tolist()
            own = own[:, :height, :width].copy()  # (not a view: a kept image would keep the whole batch)
            self._check_made(check_whole_images, own[None], size[None], 1, config)
            digest = hashlib.sha256(own.tobytes() + size.tobytes()).digest()
            made.append(ProcessedImage(own, (image.height, image.width), digest, config.feature_grid(height, width)))
        return made

    def _check_made(self, check: Callable[..., None], *arguments: Any) -> None:
        """The engine core's own `check` of what the processor made, run here to name the processor."""
        try:
            check(*arguments)
        except VLLMValidationError as exc:
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' made what the vision "
                                      f"encoder cannot take: {exc}", parameter="multi_modal_data") from None

    @staticmethod
    def _batch(images: list[Any], whole: bool) -> list[Any]:
        """The processor's batch: one image a sample, or (`whole`) one sample of them all, which
        LLaVA-OneVision's processor reads whole only (a lone image twice: it cuts a lone one's tiles)."""
        if not whole:
            return images
        return [images] if len(images) > 1 else [images * 2]

    def _processor_arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """mm_processor_kwargs as the processor takes them, over the image arguments the checkpoint's
        processor class passes by default (`_processor_class_defaults`); Qwen2-VL's min_pixels /
        max_pixels as the bounds of its `size` (as vLLM passes them; transformers deprecates the
        two names)."""
        arguments = {**self._class_defaults, **kwargs}
        if not (self.model_config.image_encoder.mrope and {"min_pixels", "max_pixels"} & set(kwargs)):
            return arguments
        size = dict(arguments.get("size") or self._processor.size)
        if "min_pixels" in arguments:
            size["shortest_edge"] = arguments.pop("min_pixels")
        if "max_pixels" in arguments:
            size["longest_edge"] = arguments.pop("max_pixels")
        return {**arguments, "size": size}

    def _patches(self, images: list[Any], values: np.ndarray, grids: np.ndarray) -> list[ProcessedImage]:
        """Qwen2-VL: each image's patches (the processor gives the batch's in one run) and grid."""
        config, made = self.model_config.image_encoder, []
        if grids.shape != (len(images), 3) or (grids[:, 0] != 1).any():
            raise VLLMValidationError(f"the image processor of '{self.model_config.model}' made patch grids "
                                      f"{grids.tolist()} for {len(images)} image(s) (one frame each expected)",
                                      parameter="multi_modal_data")
        ends = np.cumsum(grids.prod(axis=1))
        for image, grid, start, end in zip(images, grids[:, 1:], ends - grids.prod(axis=1), ends):
            own = values[start:end].copy()  # (not a view: a kept image would keep the whole batch)
            self._check_made(check_patches, own[None], grid[None], 1, config)
            digest = hashlib.sha256(own.tobytes() + grid.tobytes()).digest()
            made.append(ProcessedImage(own, (image.height, image.width), digest, (int(grid[0]), int(grid[1]))))
        return made

    def inputs(self, processed: list[ProcessedImage], token_ids: list[int]) -> tuple[list[int], ImageInputs]:
        """The prompt's token ids with each image's placeholder expanded, and its images as the
        engine takes them (`processed`: what `processed(images, uuids)` gave)."""
        config = self.model_config.image_encoder
        if config.inputs_per_image_vary:
            return self._tiled_inputs(processed, token_ids)
        if config.row_breaks:
            token_ids, offsets = self._placeholders.expand_rows(token_ids, [image.grid for image in processed])
            sizes = np.array([image.grid for image in processed], dtype=np.int64) * config.feature_pixels
            spans = np.array([config.placeholder_span(height, width) for height, width in sizes.tolist()],
                             dtype=np.int64)
            return token_ids, ImageInputs(_padded(processed), offsets, spans, [image.digest for image in processed],
                                          sizes)
        if config.mrope:
            lengths = _patch_lengths(processed, config)
            token_ids, offsets = self._placeholders.expand(token_ids, lengths)
            return token_ids, ImageInputs(_padded(processed), offsets, lengths, [image.digest for image in processed],
                                          patch_grids=np.array([image.grid for image in processed], dtype=np.int64))
        lengths = placeholder_lengths([image.size for image in processed], config)
        token_ids, offsets = self._placeholders.expand(token_ids, lengths)
        values, sizes = _stacked(processed, config.any_resolution)
        return token_ids, ImageInputs(values, offsets, lengths, [image.digest for image in processed], sizes)

    def _tiled_inputs(self, processed: list[ProcessedImage], token_ids: list[int]) -> tuple[list[int], ImageInputs]:
        """Idefics3 / SmolVLM, InternVL, Gemma 3: every tile (and whole image) or crop one encoder
        input of the engine's, hashed by its image's digest and its index there."""
        if self.model_config.image_encoder.framed:
            token_ids, offsets = self._placeholders.expand_framed(token_ids, [len(image.pixel_values) - 1
                                                                              for image in processed])
        else:
            token_ids, offsets = self._placeholders.expand_tiled(token_ids, processed)
        values = np.concatenate([image.pixel_values for image in processed])
        hashes = [hashlib.sha256(image.digest + index.to_bytes(4, "little")).digest()
                  for image in processed for index in range(len(image.pixel_values))]
        lengths = np.full(len(values), self.model_config.image_encoder.tokens_per_image, dtype=np.int64)
        return token_ids, ImageInputs(values, offsets, lengths, hashes)


def request_processor_kwargs(kwargs: Any) -> dict[str, Any] | None:
    """A request's mm_processor_kwargs, checked (vision_config.check_processor_kwargs)."""
    try:
        return check_processor_kwargs(kwargs, "mm_processor_kwargs")
    except ValueError as exc:
        raise VLLMValidationError(str(exc), parameter="mm_processor_kwargs") from None


def _not_kept(index: int, uuid: str | None) -> VLLMValidationError:
    return VLLMValidationError(f"multi_modal_data image {index} is None, and its multi_modal_uuids entry {uuid!r} "
                               f"names no image processed before (kept up to mm_processor_cache_gb): send the image",
                               parameter="multi_modal_data")


def _uuid_key(uuid: str, arguments: bytes = b"") -> bytes:
    """An image's identity by its uuid, processed with `arguments` (`_arguments_key`)."""
    return hashlib.sha256(b"\0vllm_lite image uuid\0" + uuid.encode() + arguments).digest()


def _content_key(image: Any, arguments: bytes = b"") -> bytes:
    """An RGB image's identity for the processor cache: its size and pixels, and `arguments`."""
    return hashlib.sha256(np.array(image.size, np.int64).tobytes() + image.tobytes() + arguments).digest()


def _arguments_key(kwargs: Mapping[str, Any]) -> bytes:
    """mm_processor_kwargs as part of an image's cache key (empty for none: the keys of before)."""
    if not kwargs:
        return b""
    return b"\0mm_processor_kwargs\0" + json.dumps(kwargs, sort_keys=True, default=repr).encode()


def _stacked(images: list[ProcessedImage], any_resolution: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """The prompt's pixel values in one array (LLaVA-NeXT's tiles zero-padded to the most an
    image has, as transformers' processor pads a batch) and, for LLaVA-NeXT, the images' sizes."""
    if not any_resolution:
        return np.stack([image.pixel_values for image in images]), None
    return _padded(images), np.array([image.size for image in images], dtype=np.int64)


def _padded(images: list[ProcessedImage]) -> np.ndarray:
    """The images' pixel values [images, ...], each zero-padded to the largest along every axis
    (the most tiles or patches; Mistral 3: the tallest and the widest image)."""
    shape = np.max([image.pixel_values.shape for image in images], axis=0)
    values = np.zeros((len(images), *shape), dtype=np.float32)
    for i, image in enumerate(images):
        values[(i, *(slice(0, size) for size in image.pixel_values.shape))] = image.pixel_values
    return values


def _patch_lengths(processed: list[ProcessedImage], config: Any) -> np.ndarray:
    """Qwen2-VL: each image's placeholders, one per merged square of its patches."""
    return np.array([config.merged_tokens(*image.grid) for image in processed], dtype=np.int64)


def placeholder_lengths(sizes: list[tuple[int, int]], config: Any) -> np.ndarray:
    """The placeholder tokens of images of these (height, width): one per feature each becomes
    (vision_config.py)."""
    return np.array([config.tokens_for(height, width, alone=len(sizes) == 1) for height, width in sizes],
                    dtype=np.int64)


class PlaceholderExpansion:
    """How a prompt's image placeholders become one token per image feature, as the checkpoint's
    transformers processor makes them: LLaVA's placeholder token repeated; Gemma 3's start-of-image
    token replaced by `frame_text`, the start token, the placeholders, the end token and
    `frame_text` (its processor does so in the text, so newlines around merge into the tokenizer's
    multi-newline tokens: merged here the same way, as vLLM's Gemma 3 processor merges them)."""

    def __init__(self, config: Any, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._frame: list[int] | None = None
        self._newline: list[int] | None = None  # (PaliGemma's "\n" after the prompt)
        self._tile_frame: list[int] | None = None  # (InternVL's `<img>`, `</img>` ids)
        self._row_ends: list[int] | None = None  # (Mistral 3's [IMG_BREAK], [IMG_END] ids)
        self._newline_only: dict[int, bool] = {}  # token id -> its text is newlines only
        self._image_strings: dict[tuple[int, int], list[int]] = {}  # Idefics3 / SmolVLM: grid -> its tokens

    def expand(self, token_ids: list[int], lengths: np.ndarray) -> tuple[list[int], np.ndarray]:
        """The token ids with each image's placeholder expanded (a prompt already expanded, a run
        of lengths[i] placeholders per image, is taken as it is) and each image's first
        placeholder position."""
        config = self.config
        if config.prefix_images:
            token_ids = self._prefixed(token_ids, lengths)
        if not config.framed:
            return expand_placeholders(token_ids, lengths, config.image_token_id)
        return self.expand_framed(token_ids, [0] * len(lengths))

    def _prefixed(self, token_ids: list[int], lengths: np.ndarray) -> list[int]:
        """PaliGemma: the prompt as its processor writes it (vLLM's PaliGemma prompts are its
        processor's), "<image>" per image (at the start where the prompt has none), its bos token
        after the last, the prompt's text (without a bos the tokenizer put first), then "\\n" (merged
        with newlines before it as the tokenizer merges them in the processor's text); any other
        count of placeholders (a prompt already expanded, or a wrong count) is left to
        `expand_placeholders`, which takes the one and refuses the other."""
        config = self.config
        placeholders = np.flatnonzero(np.asarray(token_ids, dtype=np.int64) == config.image_token_id)
        if len(placeholders) not in (0, len(lengths)):
            return token_ids
        self._check_tokenizer()
        bos = self.tokenizer.bos_token_id
        if bos is None:
            raise VLLMValidationError("image inputs of this model need a tokenizer with a bos token (its processor "
                                      "writes one after the images)", parameter="multi_modal_data")
        text = token_ids[1:] if token_ids[:1] == [bos] else token_ids
        if not len(placeholders):
            prompt = [config.image_token_id] * len(lengths) + [bos] + text
        else:
            last = int(placeholders[-1]) + len(text) - len(token_ids) + 1
            prompt = text[:last] + [bos] + text[last:]
        if self._newline is None:
            self._newline = self.tokenizer.encode("\n", add_special_tokens=False)
        return self._merged_newlines([(prompt, False), (self._newline, True)])

    def expand_framed(self, token_ids: list[int], crops: list[int]) -> tuple[list[int], np.ndarray]:
        """Gemma 3: each image's start-of-image token becomes `frame_text`, the start token, the
        placeholders, the end token and `frame_text`; an image with pan-and-scan crops (`crops`:
        each image's count) is written as its processor writes it, "Here is the original image",
        the image so framed, "and here are some crops to help you see better", then each crop so
        framed, space-separated (the text between special tokens tokenized whole, as the
        processor's text is; newline runs merged across the joins). Returns the token ids and each
        encoder input's first placeholder position (an image's, then its crops')."""
        config = self.config
        tokens = np.asarray(token_ids, dtype=np.int64)
        lengths = np.full(len(crops) + sum(crops), config.tokens_per_image, dtype=np.int64)
        if (tokens == config.image_token_id).any():
            return list(token_ids), _expanded_runs(tokens, lengths, config.image_token_id)
        markers = np.flatnonzero(tokens == config.start_token_id)
        if len(markers) != len(crops):
            raise _placeholder_count_error(len(markers), lengths, config.start_token_id)
        pieces: list[tuple[list[int], bool]] = []  # (tokens, inserted here)
        previous = 0
        for marker, count in zip(markers.tolist(), crops):
            pieces.append((token_ids[previous:marker], False))
            pieces.extend(self._framed_image(count))
            previous = marker + 1
        pieces.append((token_ids[previous:], False))
        expanded = self._merged_newlines(pieces)
        return expanded, _expanded_runs(np.asarray(expanded, dtype=np.int64), lengths, config.image_token_id)

    def _framed_image(self, crops: int) -> list[tuple[list[int], bool]]:
        """One image's pieces (tokens, inserted here) in Gemma 3's processor's text."""
        config, frame = self.config, self.config.frame_text
        image = ([config.start_token_id] + [config.image_token_id] * config.tokens_per_image + [config.end_token_id],
                 False)
        if not crops:
            return [(self._frame_ids(), True), image, (self._frame_ids(), True)]
        pieces = [(self._text_ids(f"Here is the original image {frame}"), True), image,
                  (self._text_ids(f"{frame} and here are some crops to help you see better {frame}"), True), image]
        for _ in range(crops - 1):
            pieces.extend([(self._text_ids(f"{frame} {frame}"), True), image])
        return [*pieces, (self._frame_ids(), True)]

    def _text_ids(self, text: str) -> list[int]:
        self._check_tokenizer()
        return self.tokenizer.encode(text, add_special_tokens=False)

    def expand_tiled(self, token_ids: list[int], images: list[Any]) -> tuple[list[int], np.ndarray]:
        """Idefics3 / SmolVLM: each image's placeholder becomes its processor's prompt string (per
        row of its tiles, `<fake_token_around_image><row_r_col_c>` and a tile's placeholders for each
        tile, then a newline; then `\n<fake_token_around_image><global-img>`, the whole image's
        placeholders and `<fake_token_around_image>`; that last part alone for an image not cut),
        tokenized whole as the processor's text is (special tokens at both ends keep it apart from
        the text around); InternVL: `<img>`, all its tiles' placeholders, `</img>`. `images`: the
        ProcessedImages. Returns the token ids and each encoder input's first placeholder position."""
        image_token, per_input = self.config.image_token_id, self.config.tokens_per_image
        tokens = np.asarray(token_ids, dtype=np.int64)
        lengths = np.full(sum(len(image.pixel_values) for image in images), per_input, dtype=np.int64)
        markers = np.flatnonzero(tokens == image_token)
        if len(markers) != len(images):
            return list(token_ids), _expanded_runs(tokens, lengths, image_token)
        out, _ = _spliced(token_ids, markers, [self._framed_ids(len(image.pixel_values)) if self.config.tile_frame
                                               else self._image_string_ids(image.grid) for image in images])
        return out, _expanded_runs(np.asarray(out, dtype=np.int64), lengths, image_token)

    def _image_string_ids(self, grid: tuple[int, int]) -> list[int]:
        """The tokens of the prompt string of an image cut into `grid` tiles (kept per grid)."""
        ids = self._image_strings.get(grid)
        if ids is not None:
            return ids
        self._check_tokenizer()
        image = self.tokenizer.convert_ids_to_tokens(self.config.image_token_id) * self.config.tokens_per_image
        whole = f"<fake_token_around_image><global-img>{image}<fake_token_around_image>"
        rows, columns = grid
        text = "".join("".join(f"<fake_token_around_image><row_{row + 1}_col_{column + 1}>{image}"
                               for column in range(columns)) + "\n" for row in range(rows))
        text = text + "\n" + whole if rows * columns else whole
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        fake = self.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
        if ids.count(self.config.image_token_id) != tile_inputs(grid) * self.config.tokens_per_image or ids[0] != fake:
            raise VLLMValidationError("the tokenizer does not read this model's image prompt string "
                                      "(<fake_token_around_image>, <global-img>, <row_r_col_c> and its image "
                                      "token as tokens of their own)", parameter="multi_modal_data")
        self._image_strings[grid] = ids
        return ids

    def expand_rows(self, token_ids: list[int], grids: list[tuple[int, int]]) -> tuple[list[int], np.ndarray]:
        """Mistral 3: each image's placeholder becomes its rows of features' placeholders, each row
        ended by [IMG_BREAK], the last by [IMG_END] (Pixtral's processor's layout); a prompt that
        already holds such row ends is taken as it is (each image's rows found in order). Returns
        the token ids and each image's first position."""
        rows = [self._image_rows(grid) for grid in grids]
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = self._row_end_ids()
        if not np.isin(tokens, ends).any():
            markers = np.flatnonzero(tokens == self.config.image_token_id)
            if len(markers) != len(grids):
                raise _placeholder_count_error(len(markers), np.array([len(r) for r in rows]), self.config.image_token_id)
            return _spliced(token_ids, markers, rows)
        offsets, start = [], 0
        for image in rows:  # (an expanded prompt: each image's rows where its first feature is)
            found = np.flatnonzero(tokens[start:] == self.config.image_token_id)
            at = start + int(found[0]) if len(found) else -1
            if at < 0 or tokens[at:at + len(image)].tolist() != image:
                raise VLLMValidationError("the prompt's image placeholders do not lie as its images' rows of "
                                          "features (each ended by [IMG_BREAK], the last by [IMG_END])",
                                          parameter="multi_modal_data")
            offsets.append(at)
            start = at + len(image)
        return list(token_ids), np.array(offsets, dtype=np.int64)

    def _image_rows(self, grid: tuple[int, int]) -> list[int]:
        rows, columns = grid
        row_break, image_end = self._row_end_ids()
        tokens = ([self.config.image_token_id] * columns + [row_break]) * rows
        tokens[-1] = image_end
        return tokens

    def _row_end_ids(self) -> list[int]:
        """Mistral 3's [IMG_BREAK], [IMG_END] ids (kept)."""
        if self._row_ends is None:
            self._row_ends = self._token_ids(self.config.row_end_tokens, "ending an image's rows")
        return self._row_ends

    def _token_ids(self, texts: tuple[str, ...], role: str) -> list[int]:
        """The ids of special tokens the tokenizer must have as tokens of their own."""
        self._check_tokenizer()
        ids = self.tokenizer.convert_tokens_to_ids(list(texts))
        if self.tokenizer.unk_token_id in ids or None in ids:
            raise VLLMValidationError(f"the tokenizer has no tokens {list(texts)} ({role})",
                                      parameter="multi_modal_data")
        return ids

    def _framed_ids(self, tiles: int) -> list[int]:
        """InternVL: an image of `tiles` tiles, its placeholders between the tile frame's tokens."""
        if self._tile_frame is None:
            self._tile_frame = self._token_ids(self.config.tile_frame, "the text around an image's placeholders")
        start, end = self._tile_frame
        return [start, *[self.config.image_token_id] * (tiles * self.config.tokens_per_image), end]

    def _frame_ids(self) -> list[int]:
        if self._frame is None:
            self._check_tokenizer()
            self._frame = self.tokenizer.encode(self.config.frame_text, add_special_tokens=False)
        return self._frame

    def _check_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise VLLMValidationError("image inputs of this model need its tokenizer (skip_tokenizer_init=True "
                                      "leaves none)", parameter="multi_modal_data")

    def _merged_newlines(self, pieces: list[tuple[list[int], bool]]) -> list[int]:
        """The pieces joined, each run of newline-only tokens that holds inserted ones
        re-tokenized as one run of newlines (the tokenizer's multi-newline tokens)."""
        tokens = [token for piece, _ in pieces for token in piece]
        inserted = [was for piece, was in pieces for _ in piece]
        out: list[int] = []
        i = 0
        while i < len(tokens):
            if not self._is_newline_only(tokens[i]):
                out.append(tokens[i])
                i += 1
                continue
            end = i
            while end < len(tokens) and self._is_newline_only(tokens[end]):
                end += 1
            run = tokens[i:end]
            if any(inserted[i:end]):
                text = self.tokenizer.decode(run)
                merged = self.tokenizer.encode(text, add_special_tokens=False)
                if all(self._is_newline_only(token) for token in merged) and self.tokenizer.decode(merged) == text:
                    run = merged
            out.extend(run)
            i = end
        return out

    def _is_newline_only(self, token: int) -> bool:
        known = self._newline_only.get(token)
        if known is None:
            text = self.tokenizer.decode([token])
            known = self._newline_only[token] = bool(text) and not text.strip("\n")
        return known


def _spliced(token_ids: list[int], markers: np.ndarray, replacements: list[list[int]]) -> tuple[list[int], np.ndarray]:
    """The token ids with the token at each of `markers` replaced by its replacement, and where
    each replacement starts."""
    out: list[int] = []
    starts, previous = [], 0
    for marker, replacement in zip(markers.tolist(), replacements):
        out.extend(token_ids[previous:marker])
        starts.append(len(out))
        out.extend(replacement)
        previous = marker + 1
    out.extend(token_ids[previous:])
    return out, np.array(starts, dtype=np.int64)


def tile_inputs(grid: tuple[int, int]) -> int:
    """Idefics3 / SmolVLM: the encoder inputs of an image its processor cut into `grid` (rows,
    columns) tiles: each tile and the whole image (the whole image alone for (0, 0))."""
    rows, columns = grid
    return rows * columns + 1 if rows * columns else 1


def _expanded_runs(tokens: np.ndarray, lengths: np.ndarray, image_token_id: int) -> np.ndarray:
    """Each image's first placeholder position in a prompt already expanded (a run of lengths[i]
    placeholders per image); refused otherwise."""
    positions = np.flatnonzero(tokens == image_token_id)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if len(positions) == bounds[-1]:
        starts = positions[bounds[:-1]]
        if np.array_equal(positions, np.concatenate([start + np.arange(n) for start, n in zip(starts, lengths)])):
            return starts.astype(np.int64)
    raise _placeholder_count_error(len(positions), lengths, image_token_id)


def _placeholder_count_error(found: int, lengths: np.ndarray, token_id: int) -> VLLMValidationError:
    return VLLMValidationError(f"the prompt holds {found} image placeholder tokens (id {token_id}) for "
                               f"{len(lengths)} image(s): give one per image (the model's chat template writes it), "
                               f"or each image's {', '.join(map(str, lengths.tolist()))} in a row",
                               parameter="multi_modal_data")


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
    return list(token_ids), _expanded_runs(tokens, lengths, image_token_id)


# processor arguments that are an image's edge in pixels (or a dict of them)
_EDGE_KEYS = ("height", "width", "longest_edge", "shortest_edge", "size", "crop_size", "max_image_size")


def _size_fields(name: str, value: Any) -> list[tuple[str, float]]:
    """(key, number) of a processor argument that sizes an image: an int, or a dict of edges /
    pixel counts (Qwen's min_pixels / max_pixels too)."""
    if name in ("min_pixels", "max_pixels"):
        return [(name, _number(value))]
    if name not in ("size", "crop_size", "max_image_size"):
        return []
    if isinstance(value, Mapping):
        return [(key, _number(number)) for key, number in value.items() if key in (*_EDGE_KEYS, "min_pixels")]
    return [(name, _number(value))]


def _longest_edge(size: Any) -> float:
    """A size's longest_edge (a dict's, or a processor's SizeDict's)."""
    return _number(size.get("longest_edge") if isinstance(size, Mapping) else getattr(size, "longest_edge", None))


def _number(value: Any) -> float:
    """A numeric argument's value (anything else: 0, left to the processor to refuse)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _processor_class_defaults(model: str) -> dict[str, Any]:
    """The image arguments the checkpoint's transformers processor class passes its image
    processor unless told otherwise (its `images_kwargs`: InternVL's crop_to_patches, Gemma 3's
    pan-and-scan settings, over what preprocessor_config.json says, as vLLM's processing gets
    them). Pixtral's class needs torchvision to import: the engine sets its one argument itself."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        model_type = json.loads((Path(model) / "config.json").read_text()).get("model_type")
        name = PROCESSOR_MAPPING_NAMES.get(model_type)
        return dict(getattr(getattr(transformers, name), "images_kwargs", None) or {}) if name else {}
    except (ImportError, OSError, ValueError):
        return {}


def _load_image_processor(model: str) -> Any:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model)
    except (OSError, ValueError) as exc:
        raise VLLMValidationError(f"image inputs need the checkpoint's image processor "
                                  f"(preprocessor_config.json in '{model}'): {exc}",
                                  parameter="multi_modal_data") from None
