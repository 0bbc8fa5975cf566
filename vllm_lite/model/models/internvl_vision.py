"""The vision side of InternVL (its transformers-format checkpoints, InternVL3-*-hf): InternViT
over each of an image's tiles (a CLS token and learned positions, then layers whose attention and
MLP outputs are scaled per channel by `lambda_1` / `lambda_2` before their residual adds; layer or
RMS norms, optionally RMS-normed q and k over all heads), its patch features (CLS dropped)
pixel-shuffled into one feature per square of patches and projected by a normed two-layer MLP.

As transformers' InternVLVisionModel and InternVLMultiModalProjector; its names are the
checkpoint's (`vision_tower.*`, `multi_modal_projector.*`, or under `model.`). Runs once per tile
when its request joins a step (worker/prompt_embeds.py splices the rows in)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.model.layers.activation import plain_activation
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.models.llava_vision import VisionMlp, pixel_shuffled
from vllm_lite.model.models.vision_side import CheckpointVisionSide
from vllm_lite.vision_config import ImageEncoderConfig


def _norm(config: ImageEncoderConfig) -> nn.Module:
    if config.vision_norm == "rms_norm":
        return RMSNorm(config.hidden_size, config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                    stride=config.patch_size)


class Embeddings(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.empty(1, 1, config.hidden_size))
        self.patch_embeddings = PatchEmbeddings(config)
        self.position_embeddings = nn.Parameter(torch.empty(1, config.num_positions + 1, config.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        projection = self.patch_embeddings.projection
        patches = projection(pixel_values.to(projection.weight.dtype)).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(pixel_values), -1, -1), patches], dim=1)
        return tokens + self.position_embeddings


class Attention(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        width, bias = config.hidden_size, config.vision_attention_bias
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=bias) for _ in range(3))
        self.projection_layer = nn.Linear(width, width)
        if config.vision_qk_norm:  # (over all heads' q, and k, at once; transformers' eps)
            self.q_norm, self.k_norm = RMSNorm(width, 1e-6), RMSNorm(width, 1e-6)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, tokens, width = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(tiles, tokens, self.num_heads, -1).transpose(1, 2)

        attended = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        return self.projection_layer(attended.transpose(1, 2).reshape(tiles, tokens, width))


class Layer(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.mlp = VisionMlp(config)
        self.layernorm_before = _norm(config)
        self.layernorm_after = _norm(config)
        self.lambda_1 = nn.Parameter(torch.empty(config.hidden_size))
        self.lambda_2 = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class Encoder(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(config) for _ in range(config.num_layers))


class VisionTower(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(self, pixel_values: torch.Tensor, layers: int) -> torch.Tensor:
        """The hidden state after the first `layers` layers (transformers' hidden_states[layers])."""
        state = self.embeddings(pixel_values)
        for layer in self.encoder.layer[:layers]:
            state = layer(state)
        return state


class Projector(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        width = config.hidden_size * config.pixel_shuffle ** 2
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1 = nn.Linear(width, config.text_hidden_size)
        self.act = plain_activation(config.projector_act)
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLImageEncoder(CheckpointVisionSide):
    """Tiles -> each one's input embeddings [tile tokens, text hidden size] (transformers'
    InternVLModel.get_image_features)."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.multi_modal_projector = Projector(config)

    @staticmethod
    def read_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """All but the mask token a checkpoint may hold (`use_mask_token`: masked-image
        pretraining's, never used at inference)."""
        return ((name, weight) for name, weight in weights if not name.endswith("embeddings.mask_token"))

    def forward(self, pixel_values: torch.Tensor, image_sizes: list[list[int]] | None = None,
                alone: bool = True) -> list[torch.Tensor]:
        """`pixel_values` [tiles, channels, size, size] (each tile an encoder input of its own)."""
        config = self.config
        layers = config.feature_layers[0] % (config.num_layers + 1)  # (-1: the last layer's output)
        patches = self.vision_tower(pixel_values, layers)[:, 1:]
        return list(self.multi_modal_projector(pixel_shuffled(patches, config.pixel_shuffle)))
