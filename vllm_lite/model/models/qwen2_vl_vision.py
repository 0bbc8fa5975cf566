"""The vision side of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision transformer over an image's
patches (any image size: its processor resizes to whole 28-pixel squares and cuts 14-pixel
patches, Qwen3-VL's 32 and 16, each 2 x 2 square of them in a row), with 2-D rotary positions (a
patch's row and column) and attention within each image, then the merger: each square's four
patch states normed, concatenated and projected by a two-layer MLP into one language-model input
embedding (one per image placeholder token). Qwen2.5-VL's blocks use RMS norms and gated MLPs, and
all but its full-attention blocks attend within windows of merged squares (the patches laid out
window by window meanwhile). Qwen3-VL's add learned position embeddings (a square grid bilinearly
resampled to each image's) to the patch embeddings, and its DeepStack blocks' states, merged by
mergers of their own, ride along after each feature (the language model adds them to its hidden
states after its first layers: model_runner.py).

As transformers' Qwen2VisionTransformerPretrainedModel, Qwen2_5_VisionTransformerPretrainedModel
and Qwen3VLVisionModel; its names are the checkpoint's (`visual.*`, or `model.visual.*` as newer
transformers save them). Runs once per image when its request joins a step
(worker/prompt_embeds.py splices the rows in; worker/mrope.py gives the placeholders their
multimodal rotary positions)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.model.layers.activation import plain_activation
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import rotate_half
from vllm_lite.model.models.llava_vision import VisionMlp
from vllm_lite.model.models.vision_side import CheckpointVisionSide
from vllm_lite.vision_config import ImageEncoderConfig


class PatchEmbed(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.shape = (config.num_channels, config.temporal_patch, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.num_channels, config.hidden_size, kernel_size=self.shape[1:],
                              stride=self.shape[1:], bias=config.learned_positions)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[patches, channels x frames x size x size] -> [patches, width]."""
        weight = self.proj.weight
        return self.proj(patches.to(weight.dtype).view(-1, *self.shape)).view(len(patches), -1)


class VisionAttention(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """`x` [patches, width] in runs of `lengths` patches (an image each, or Qwen2.5-VL's windows),
        each run attending within itself."""
        q, k, v = self.qkv(x).view(len(x), 3, self.num_heads, -1).unbind(1)
        q, k = _rotated(q, cos, sin), _rotated(k, cos, sin)
        attended = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in image)).transpose(0, 1)
                    for image in zip(q.split(lengths), k.split(lengths), v.split(lengths))]
        return self.proj(torch.cat(attended).reshape(len(x), -1))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope in float32 (as transformers' vision rope computes it), back in x's dtype."""
    values = x.float()
    return (values * cos + rotate_half(values) * sin).to(x.dtype)


class GatedVisionMlp(nn.Module):
    """Qwen2.5-VL's: down(act(gate(x)) * up(x)), each with a bias (Pixtral's: without)."""

    def __init__(self, config: ImageEncoderConfig, bias: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.act = plain_activation(config.hidden_act)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _norm(config: ImageEncoderConfig) -> nn.Module:
    """Qwen2.5-VL's RMS norm, Qwen2-VL's layer norm."""
    if config.windowed:
        return RMSNorm(config.hidden_size, config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class VisionBlock(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.norm1 = _norm(config)
        self.attn = VisionAttention(config)
        self.norm2 = _norm(config)
        self.mlp = GatedVisionMlp(config) if config.windowed else VisionMlp(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, lengths)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.merged_width = config.hidden_size * config.spatial_merge ** 2
        self.ln_q = _norm(config)
        self.mlp = nn.Sequential(nn.Linear(self.merged_width, self.merged_width), nn.GELU(),
                                 nn.Linear(self.merged_width, config.text_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_width))


class Qwen3PatchMerger(nn.Module):
    """Qwen3-VL's merger (its names): a square's patch states normed each (or, `after_merge`,
    as the one concatenated state: its DeepStack mergers), then the two-layer MLP."""

    def __init__(self, config: ImageEncoderConfig, after_merge: bool) -> None:
        super().__init__()
        self.merged_width = config.hidden_size * config.spatial_merge ** 2
        self.after_merge = after_merge
        self.norm = nn.LayerNorm(self.merged_width if after_merge else config.hidden_size, eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.merged_width, self.merged_width)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged_width, config.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.norm(x.view(-1, self.merged_width)) if self.after_merge else self.norm(x).view(-1, self.merged_width)
        return self.linear_fc2(self.act(self.linear_fc1(merged)))


class VisionTransformer(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        if config.learned_positions:  # (Qwen3-VL)
            self.pos_embed = nn.Embedding(config.position_embeddings, config.hidden_size)
            self.merger = Qwen3PatchMerger(config, after_merge=False)
            self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(config, after_merge=True)
                                                       for _ in config.deepstack_blocks)
        else:
            self.merger = PatchMerger(config)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """`patches` [patches, values] of images of `grids` (rows, columns) patches each, in the
        processor's order -> [patches / merge², text width]."""
        config, device = self.config, self.patch_embed.proj.weight.device
        positions = torch.cat([self._patch_positions(rows, columns) for rows, columns in grids]).to(device)
        quarter = config.hidden_size // config.num_heads // 4  # (row and column each turn a quarter)
        # (float32 whatever the model's dtype, as transformers computes it)
        inv_freq = 1.0 / config.vision_rope_theta ** (torch.arange(quarter, device=device) / quarter)
        angles = (positions.float()[..., None] * inv_freq).flatten(1)
        angles = torch.cat((angles, angles), dim=-1)  # [patches, head size]
        lengths = [rows * columns for rows, columns in grids]
        x = self.patch_embed(patches)
        if config.learned_positions:
            x = x + self._learned_positions(grids).to(x.dtype)
        order, windows = self._window_order(grids) if config.windowed else (None, lengths)
        if order is not None:  # (Qwen2.5-VL: patches laid out window by window, each square whole)
            x, angles = self._squares(x)[order].flatten(0, 1), self._squares(angles)[order].flatten(0, 1)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # (one for every head)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, lengths if order is None or index in config.full_attention_blocks else windows)
            if index in config.deepstack_blocks:
                deepstack.append(self.deepstack_merger_list[config.deepstack_blocks.index(index)](x))
        merged = self.merger(x)
        if deepstack:  # (each feature: its input embedding, then its DeepStack additions)
            merged = torch.cat([merged, *deepstack], dim=-1)
        return merged if order is None else merged[torch.argsort(order)]

    def _learned_positions(self, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Qwen3-VL: each patch's position embedding, the learned square grid resampled to its
        image's grid (bilinear, corners aligned: transformers' four taps and weights), in the
        processor's patch order."""
        side = math.isqrt(self.config.position_embeddings)
        device = self.pos_embed.weight.device
        embeddings = []
        for rows, columns in grids:
            row, column = self._patch_positions(rows, columns).unbind(-1)
            (row_taps, row_weights), (column_taps, column_weights) = (_bilinear_taps(row, rows, side),
                                                                      _bilinear_taps(column, columns, side))
            taps = (row_taps[:, :, None] * side + column_taps[:, None, :]).flatten(1).to(device)
            weights = (row_weights[:, :, None] * column_weights[:, None, :]).flatten(1).to(device)
            embeddings.append((self.pos_embed(taps) * weights[:, :, None]).sum(1))
        return torch.cat(embeddings)

    def _squares(self, x: torch.Tensor) -> torch.Tensor:
        """[patches, ...] -> [merged squares, merge², ...] (a square's patches are in a row)."""
        return x.view(-1, self.config.spatial_merge ** 2, *x.shape[1:])

    def _window_order(self, grids: list[tuple[int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merged squares of the images in window order (each image's windows of
        `window_size` pixels row by row, a window's squares row by row) and each window's patches."""
        config = self.config
        merge = config.spatial_merge
        side = config.window_size // (merge * config.patch_size)  # (a window's squares per side)
        order, windows, first = [], [], 0
        for rows, columns in grids:
            squares = torch.arange(rows // merge * (columns // merge)).view(rows // merge, columns // merge) + first
            for top in range(0, squares.shape[0], side):
                for left in range(0, squares.shape[1], side):
                    window = squares[top:top + side, left:left + side].flatten()
                    order.append(window)
                    windows.append(len(window) * merge ** 2)
            first += squares.numel()
        return torch.cat(order).to(self.merger.ln_q.weight.device), windows

    def _patch_positions(self, rows: int, columns: int) -> torch.Tensor:
        """Each patch's (row, column) in the processor's order: merge x merge squares, row-major."""
        merge = self.config.spatial_merge
        row, column = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
        squares = (rows // merge, merge, columns // merge, merge)
        return torch.stack([row.reshape(squares).transpose(1, 2).flatten(),
                            column.reshape(squares).transpose(1, 2).flatten()], dim=-1)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Along one axis of `size` positions, each position's two neighbours on an axis of `side`
    (corners aligned) and their weights."""
    source = index.float() * (side - 1) / max(size - 1, 1)
    low = source.floor()
    offsets = torch.arange(2)
    taps = (low.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - low[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen2VLImageEncoder(CheckpointVisionSide):
    """Images -> each one's features [rows x columns / merge², feature width]: its input
    embeddings (and Qwen3-VL's DeepStack additions after them) (transformers'
    Qwen2VLModel.get_image_features)."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTransformer(config)

    def map_checkpoint_name(self, name: str) -> tuple[str, Any]:
        # (Qwen3-VL names its blocks' MLP layers linear_fc1 / linear_fc2)
        return name.removeprefix("model.").replace(".mlp.linear_fc", ".mlp.fc"), None

    def forward(self, pixel_values: torch.Tensor, grids: list[list[int]]) -> list[torch.Tensor]:
        """`pixel_values` [images, patches (padded to the most), values]; `grids` each image's
        (rows, columns) of patches."""
        patches = torch.cat([image[:rows * columns] for image, (rows, columns) in zip(pixel_values, grids)])
        features = self.visual(patches, [(rows, columns) for rows, columns in grids])
        return list(features.split([self.config.merged_tokens(rows, columns) for rows, columns in grids]))
