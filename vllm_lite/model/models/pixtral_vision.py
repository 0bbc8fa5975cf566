"""The vision side of Mistral 3 (Mistral Small 3.1 / 3.2): Pixtral over each image whole, at
its own size (the processor resizes it to whole squares of merged patches, at most the encoder's
size on a side): patch embeddings RMS-normed, then layers of attention within the image with 2-D
rotary positions (a patch's row and column) and gated MLPs; one layer's patch states RMS-normed,
each spatial_merge x spatial_merge square of them merged by a linear layer, then projected by a
two-layer MLP into one language-model input embedding per [IMG] placeholder (row by row; the
prompt's [IMG_BREAK] / [IMG_END] after each row are its own tokens: worker/prompt_embeds.py splices
the rows around them).

As transformers' PixtralVisionModel and Mistral3MultiModalProjector; its names are the
checkpoint's (`vision_tower.*`, `multi_modal_projector.*`, or under `model.`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_lite.model.layers.activation import plain_activation
from vllm_lite.model.layers.norm import RMSNorm
from vllm_lite.model.layers.rotary import rotate_half
from vllm_lite.model.models.qwen2_vl_vision import GatedVisionMlp
from vllm_lite.model.models.vision_side import CheckpointVisionSide
from vllm_lite.vision_config import ImageEncoderConfig


class Attention(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        width = config.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """`x` [patches, width], runs of `lengths` patches (an image each) attending within themselves."""
        def heads(projection: nn.Linear) -> torch.Tensor:
            return projection(x).view(len(x), self.num_heads, -1).transpose(0, 1)

        q, k, v = heads(self.q_proj), heads(self.k_proj), heads(self.v_proj)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        attended = [F.scaled_dot_product_attention(*image) for image in
                    zip(q.split(lengths, dim=1), k.split(lengths, dim=1), v.split(lengths, dim=1))]
        return self.o_proj(torch.cat(attended, dim=1).transpose(0, 1).reshape(len(x), -1))


class Layer(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.feed_forward = GatedVisionMlp(config, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_layers))


class VisionTower(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_conv = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                    stride=config.patch_size, bias=False)
        self.ln_pre = RMSNorm(config.hidden_size, config.layer_norm_eps)
        self.transformer = Transformer(config)

    def forward(self, pixel_values: torch.Tensor, sizes: list[tuple[int, int]], layers: int) -> torch.Tensor:
        """The images' patch states [patches, width] after the first `layers` layers
        (transformers' hidden_states[layers]), each image's patches row-major."""
        patch = self.config.patch_size
        grids = [(height // patch, width // patch) for height, width in sizes]
        weight = self.patch_conv.weight
        patches = torch.cat([self.patch_conv(image[None, :, :height, :width].to(weight.dtype))[0].flatten(1).T
                             for image, (height, width) in zip(pixel_values, sizes)])
        cos, sin = self._rotary(grids, patches.dtype)
        lengths = [rows * columns for rows, columns in grids]
        state = self.ln_pre(patches)
        for layer in self.transformer.layers[:layers]:
            state = layer(state, cos, sin, lengths)
        return state

    def _rotary(self, grids: list[tuple[int, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's cos / sin [patches, head size]: the first quarter of the pairs turned by
        its row (the even frequencies of a head-size rope), the second by its column (the odd)."""
        config, device = self.config, self.patch_conv.weight.device
        head_dim = config.hidden_size // config.num_heads
        inv_freq = 1.0 / config.vision_rope_theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
        positions = torch.cat([torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij"),
                                           dim=-1).reshape(-1, 2) for rows, columns in grids]).to(device)
        angles = torch.cat((positions[:, :1] * inv_freq[0::2], positions[:, 1:] * inv_freq[1::2]), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


class PatchMerger(nn.Module):
    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.merge = config.spatial_merge
        self.merging_layer = nn.Linear(config.hidden_size * self.merge ** 2, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """Each image's square of merge x merge patch states as one (channel by channel, the
        square's patches row-major within each: transformers' unfold), merged; row-major."""
        merge, width = self.merge, x.shape[-1]
        squares = [image.view(rows // merge, merge, columns // merge, merge, width).permute(0, 2, 4, 1, 3)
                   .reshape(-1, width * merge * merge)
                   for image, (rows, columns) in zip(x.split([rows * columns for rows, columns in grids]), grids)]
        return self.merging_layer(torch.cat(squares))


class Projector(nn.Module):
    """Mistral 3's (norm, patch merger, MLP); Pixtral-12B's LLaVA one (the MLP alone)."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        if config.patch_merger:
            self.norm = RMSNorm(config.hidden_size, config.projector_norm_eps)
            self.patch_merger = PatchMerger(config)
        else:
            self.norm = self.patch_merger = None
        self.linear_1 = nn.Linear(config.hidden_size, config.text_hidden_size, bias=config.projector_bias)
        self.act = plain_activation(config.projector_act)
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size, bias=config.projector_bias)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        if self.patch_merger is not None:
            x = self.patch_merger(self.norm(x), grids)
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralImageEncoder(CheckpointVisionSide):
    """Images -> each one's input embeddings [rows x columns of features, text hidden size]
    (transformers' Mistral3Model.get_image_features)."""

    def __init__(self, config: ImageEncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = VisionTower(config)
        self.multi_modal_projector = Projector(config)

    def forward(self, pixel_values: torch.Tensor, image_sizes: list[list[int]] | None = None,
                alone: bool = True) -> list[torch.Tensor]:
        """`pixel_values` [images, channels, height, width] (zero-padded to the largest);
        `image_sizes`: each image's (height, width) there."""
        config = self.config
        sizes = [(height, width) for height, width in image_sizes]
        layers = config.feature_layers[0] % (config.num_layers + 1)  # (-1: the last layer's output)
        states = self.vision_tower(pixel_values, sizes, layers)
        grids = [(height // config.patch_size, width // config.patch_size) for height, width in sizes]
        features = self.multi_modal_projector(states, grids)
        return list(features.split([config.feature_grid(*size)[0] * config.feature_grid(*size)[1] for size in sizes]))
