"""The vision side of LLaVA 1.5, LLaVA-NeXT / OneVision, Gemma 3 and PaliGemma: a CLIP or SigLIP vision
transformer and the projector that turns its patch features into language-model input embeddings (one
per image placeholder token; LLaVA-NeXT's and OneVision's tiles packed as `LlavaImageEncoder._packed`
says; Gemma 3's pooled by `Gemma3Projector`; PaliGemma's projected by one linear layer,
`PaliGemmaProjector`; Idefics3 / SmolVLM's tiles, each an input, by `PixelShuffleConnector`).
The two encoders differ only in their embeddings (CLIP: a CLS token, a patch projection without
bias, a layer norm before the layers; SigLIP: none of these) and their layers' activation.

Runs once per image when its request joins a step (worker/prompt_embeds.py splices the rows in);
every rank holds all of it (it is small beside the language model, and its output is needed
whole). Its names are the checkpoint's (`vision_tower.vision_model.*`, `multi_modal_projector.*`;
also under `model.`, and `vision_tower.*` without `vision_model.`, as newer transformers save them)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.model.layers.activation import plain_activation
from vllm_lite.model.layers.norm import GemmaRMSNorm
from vllm_lite.vision_config import ImageEncoderConfig


class VisionEmbeddings(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size)) if config.has_cls else None
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size, bias=not config.has_cls)
        self.position_embedding = nn.Embedding(config.num_positions, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            patches = torch.cat([self.class_embedding.expand(len(pixel_values), 1, -1), patches], dim=1)
        return patches + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        width = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, tokens, width = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(images, tokens, self.num_heads, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj))
        return self.out_proj(attended.transpose(1, 2).reshape(images, tokens, width))


class VisionMlp(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = plain_activation(config.hidden_act)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_layers))


class VisionModel(nn.Module):
    """The vision transformer; its post_layernorm (of the final output: LLaVA does not read it,
    Gemma 3 does) is run by the encoder that reads it."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        # (CLIP's spelling)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if config.has_cls else None
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def hidden_states(self, pixel_values: torch.Tensor, wanted: Collection[int]) -> dict[int, torch.Tensor]:
        """transformers' hidden states of the indices `wanted` (0: the embeddings, k: layer k's
        output), the layers after the last of them not run, no other state kept."""
        state = self.embeddings(pixel_values)
        if self.pre_layrnorm is not None:
            state = self.pre_layrnorm(state)
        kept = {0: state} if 0 in wanted else {}
        for index, layer in enumerate(self.encoder.layers[:max(wanted)], start=1):
            state = layer(state)
            if index in wanted:
                kept[index] = state
        return kept


class VisionTower(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.vision_model = VisionModel(config)


class LlavaProjector(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        features = config.hidden_size * len(config.feature_layers)
        self.linear_1 = nn.Linear(features, config.text_hidden_size, bias=config.projector_bias)
        self.act = plain_activation(config.projector_act)
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size, bias=config.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Gemma3Projector(nn.Module):
    """Gemma 3's (transformers' Gemma3MultiModalProjector): the patch grid average-pooled to
    `pooled_tokens` features, RMS-normed (Gemma's 1 + w), projected without a bias."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.patches_per_side = config.image_size // config.patch_size
        self.pool = self.patches_per_side // int(round(config.pooled_tokens ** 0.5))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(config.hidden_size, config.text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, _, width = x.shape
        grid = x.transpose(1, 2).reshape(images, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(x.dtype)


class PaliGemmaProjector(nn.Module):
    """PaliGemma's (transformers' PaliGemmaMultiModalProjector): one linear layer with a bias. Its
    output enters the language model unscaled (Gemma scales its token embeddings alone)."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.linear = nn.Linear(config.hidden_size, config.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class PixelShuffleModalityProjection(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.hidden_size * config.pixel_shuffle ** 2, config.text_hidden_size, bias=False)


class PixelShuffleConnector(nn.Module):
    """Idefics3 / SmolVLM's (transformers' SmolVLMConnector): each `scale` x `scale` square of
    patch features concatenated into one feature (in its row-major order), then projected."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.scale = config.pixel_shuffle
        self.modality_projection = PixelShuffleModalityProjection(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffled(x, self.scale))


def pixel_shuffled(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[inputs, patches (a square grid, row-major), width] -> [inputs, patches / scale², scale² x
    width]: each scale x scale square of patch features concatenated (in its row-major order) into
    one, the squares row-major (Idefics3 / SmolVLM's pixel shuffle, and InternVL's)."""
    inputs, patches, width = x.shape
    side = int(round(patches ** 0.5))
    return (x.view(inputs, side // scale, scale, side // scale, scale, width).permute(0, 1, 3, 2, 4, 5)
            .reshape(inputs, patches // scale ** 2, scale * scale * width))


def _ours(name: str) -> str:
    """A checkpoint name of the vision side as this module names it."""
    name = name.removeprefix("model.")
    if name.startswith("vision_model."):  # (Idefics3 / SmolVLM's names)
        return "vision_tower." + name
    if name.startswith("connector."):
        return "multi_modal_projector." + name.removeprefix("connector.")
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")  # (transformers 5's form)
    return name


class LlavaImageEncoder(nn.Module):
    """Images -> each one's input embeddings [tokens, text hidden size]: LLaVA 1.5's features of
    the image (transformers' LlavaModel.get_image_features); LLaVA-NeXT's of the whole image, then
    of its tiles laid out as the image, cut to its aspect ratio, each row ended by `image_newline`
    (LlavaNextModel.pack_image_features); Gemma 3's pooled features (Gemma3Model.get_image_features)."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.multi_modal_projector = (Gemma3Projector(config) if config.pooled_tokens
                                      else PixelShuffleConnector(config) if config.pixel_shuffle
                                      else PaliGemmaProjector(config) if config.prefix_images
                                      else LlavaProjector(config))
        self.image_newline = nn.Parameter(torch.empty(config.text_hidden_size)) if config.any_resolution else None

    def map_checkpoint_name(self, name: str) -> tuple[str, Any]:
        return _ours(name), None

    @staticmethod
    def read_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The vision side's checkpoint tensors this encoder reads: all but SigLIP's pooling head
        (`vision_use_head`), which LLaVA never runs."""
        return ((name, weight) for name, weight in weights
                if not _ours(name).startswith("vision_tower.vision_model.head."))

    def forward(self, pixel_values: torch.Tensor, image_sizes: list[list[int]] | None = None,
                alone: bool = True) -> list[torch.Tensor]:
        """`pixel_values`: [images, channels, h, w], or LLaVA-NeXT's [images, tiles, channels, h,
        w] with each image's (height, width) in `image_sizes`; `alone`: the images' prompt holds
        one image (LLaVA-OneVision reads those of a prompt with several whole only)."""
        if not self.config.any_resolution:
            return list(self._features(pixel_values))
        counts = [self.config.tiles_for(height, width, alone) for height, width in image_sizes]
        tiles = torch.cat([image[:count] for image, count in zip(pixel_values, counts)])
        features = self._features(tiles).split(counts)
        return [self._packed(image, height, width) for image, (height, width) in zip(features, image_sizes)]

    def _features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[inputs, channels, h, w] -> [inputs, features, text hidden size]."""
        config = self.config
        depth = config.num_layers + 1  # (a negative layer counts from the last of all hidden states)
        wanted = [layer % depth for layer in config.feature_layers]
        states = self.vision_tower.vision_model.hidden_states(pixel_values, set(wanted))
        if config.reads_final_state:  # (Gemma 3, SmolVLM, PaliGemma: SigLIP's last_hidden_state, post-layernormed)
            return self.multi_modal_projector(self.vision_tower.vision_model.post_layernorm(states[wanted[0]]))
        first = 0 if config.keep_first_feature else 1
        features = torch.cat([states[index][:, first:] for index in wanted], dim=-1)
        return self.multi_modal_projector(features)

    def _packed(self, features: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """LLaVA-NeXT: the whole image's features, then the tiles' as one grid of the image's
        layout, the padding rows or columns the resize added cut off (LLaVA-OneVision: then scaled
        down to `packed_features`), a newline after each row; an image read whole only: its
        features and one newline."""
        config = self.config
        if len(features) == 1:
            return torch.cat([features[0], self.image_newline[None].to(features.dtype)])
        rows, columns = config.tile_grid(height, width)
        side = config.image_size // config.patch_size
        grid = (features[1:].view(rows, columns, side, side, -1).permute(4, 0, 2, 1, 3)
                .reshape(-1, rows * side, columns * side))
        kept_height, kept_width = config.unpadded_features(height, width)
        top, left = (rows * side - kept_height) // 2, (columns * side - kept_width) // 2
        grid = grid[:, top:top + kept_height, left:left + kept_width]
        packed = config.packed_features(height, width)
        if packed != (kept_height, kept_width):
            grid = F.interpolate(grid[None], list(packed), mode="bilinear")[0]
        newlines = self.image_newline[:, None, None].expand(-1, grid.shape[1], 1).to(grid.dtype)
        grid = torch.cat([grid, newlines], dim=2)
        return torch.cat([features[0], grid.flatten(1).transpose(0, 1)])
