"""Image inputs of a multimodal checkpoint: which checkpoints take them, and how their vision
side is read (vLLM's multimodal models; here LLaVA 1.5's form: a CLIP or SigLIP vision encoder, a
two-layer projector, an image placeholder token expanded to one token per image feature;
LLaVA-Interleave is this form with SigLIP; LLaVA-NeXT's tiles; LLaVA-OneVision's, LLaVA-NeXT's
with its tile features scaled down past `anyres_max_N` tiles' worth and a prompt's several images
read whole only; Gemma 3's: SigLIP's last layer
average-pooled to `mm_tokens_per_image` features, each image's tokens framed by its start and end
tokens and attending to each other both ways, vLLM's "mm prefix LM"; PaliGemma's: SigLIP's last
layer projected by one linear layer, the images' placeholders before the prompt's bos token and
text (its processor's form), attending to each other both ways as Gemma 3's; Idefics3 / SmolVLM's: an
image read as its processor's tiles and the whole image, each a SigLIP-shaped encoder input whose
last hidden state is pixel-shuffled and projected, each its own run of placeholders between the
processor's row / column tokens; Qwen2-VL's: an image of any size read as its processor's patches
by a vision transformer with 2-D rotary positions, each 2 x 2 square of patches merged into one
feature, whose placeholders take multimodal rotary positions (M-RoPE) in the language model;
Qwen2.5-VL's: the same with RMS norms, gated MLPs and attention within windows of patches in
most of its blocks; Qwen3-VL's: Qwen2-VL's with learned patch position embeddings resampled to each
image's grid, interleaved M-RoPE sections and DeepStack: some of its blocks' states, merged by
their own mergers, added to the language model's hidden states at the image's placeholders after
its first layers; InternVL's: an image as its processor's tiles, each read by InternViT, pixel-shuffled
and projected, all its tiles' placeholders one run between `<img>` and `</img>`; Mistral 3's: an
image read whole at its own size by Pixtral with 2-D rotary positions, 2 x 2 squares of patch
states merged, its placeholder rows each ended by a token of its own).

A multimodal checkpoint whose vision side is not implemented here is still served as its language
model (multimodal_checkpoints.py); its `images_refused` reason names what is missing, and a
request carrying an image is refused with it.

Torch-free: the engine configuration reads this before any worker starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# the architectures whose image inputs are implemented
IMAGE_ARCHITECTURES = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                       "Gemma3ForConditionalGeneration", "SmolVLMForConditionalGeneration",
                       "Idefics3ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                       "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                       "Qwen3VLMoeForConditionalGeneration", "LlavaOnevisionForConditionalGeneration",
                       "InternVLForConditionalGeneration", "Mistral3ForConditionalGeneration",
                       "PaliGemmaForConditionalGeneration")
# vLLM's default limit of inputs of one modality per prompt (its MultiModalConfig)
DEFAULT_IMAGES_PER_PROMPT = 999
# the architectures whose prompts take fewer images (vLLM's get_supported_mm_limits; PaliGemma's
# processor puts all a prompt's images into one two-way block, vLLM's mask each image into its own)
SUPPORTED_IMAGES_PER_PROMPT = {"PaliGemmaForConditionalGeneration": 1}
# the vision encoders implemented (model/models/llava_vision.py): CLIP's has a CLS token and a
# layer norm before its layers, SigLIP's neither (and a patch projection with a bias)
_VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model")
# Idefics3 / SmolVLM's encoders: SigLIP's layers with position ids bucketed for partly padded
# inputs (its processor's tiles are never padded: their ids are SigLIP's)
_TILE_VISION_MODEL_TYPES = ("idefics3_vision", "smolvlm_vision")
# Qwen2-VL's and Qwen2.5-VL's vision transformers: fields read (older configs spell in_channels
# `in_chans` and repeat patch_size as `spatial_patch_size`: read where they agree; Qwen2.5-VL's
# `tokens_per_second` spaces a video's frames, and videos are refused)
# (by vision model_type)
_QWEN_VL_VISION_READ = {
    "qwen2_vl_vision": frozenset({
        "depth", "embed_dim", "hidden_size", "hidden_act", "mlp_ratio", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "rope_parameters", "in_chans", "spatial_patch_size"}),
    "qwen2_5_vl_vision": frozenset({
        "depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "rope_parameters", "in_chans", "spatial_patch_size",
        "out_hidden_size", "window_size", "fullatt_block_indexes", "tokens_per_second"}),
    "qwen3_vl_vision": frozenset({
        "depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
        "spatial_merge_size", "temporal_patch_size", "rope_parameters", "out_hidden_size",
        "num_position_embeddings", "deepstack_visual_indexes"}),
}
_QWEN_VL_VISION_READ["qwen3_vl_moe_vision"] = _QWEN_VL_VISION_READ["qwen3_vl_vision"]  # (the MoE's: the same)
# InternVL's InternViT (transformers' InternVLVisionModel): fields read (its dropouts, stochastic
# depth and layer-scale init change nothing at inference; a mask token is never used)
_INTERNVL_VISION_READ = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "image_size",
    "patch_size", "layer_norm_eps", "hidden_act", "attention_bias", "use_qk_norm", "norm_type",
    "use_absolute_position_embeddings", "use_mean_pooling", "use_mask_token", "hidden_dropout_prob",
    "projection_dropout", "layer_scale_init_value", "drop_path_rate"})
_INTERNVL_NORMS = ("layer_norm", "rms_norm")
# Mistral 3's Pixtral encoder (transformers' PixtralVisionModel): fields read
_PIXTRAL_VISION_READ = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "image_size",
    "patch_size", "hidden_act", "head_dim", "rope_parameters"})
_QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                          "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
# transformers' default when a Qwen2-VL text config names no mrope_section (7B's head size, 128)
_DEFAULT_MROPE_SECTION = (16, 24, 24)
_QWEN3_MROPE_SECTION = (24, 20, 20)  # (Qwen3-VL's: transformers' Qwen3VLTextRotaryEmbedding default)
_SELECT_STRATEGIES = ("default", "full")  # drop the first feature (CLIP's CLS) / keep it
# the activations model/layers/activation.py `plain_activation` runs
PLAIN_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "quick_gelu", "relu", "silu")
# CLIPVisionConfig fields that change nothing at inference (the projection head and the text
# side of a full CLIP model are not part of a vision tower) besides transformers' metadata
_VISION_INERT = frozenset({"model_type", "projection_dim", "attention_dropout", "dropout", "initializer_range",
                           "initializer_factor", "torch_dtype", "dtype", "transformers_version", "vocab_size",
                           "architectures", "_name_or_path", "output_attentions", "output_hidden_states",
                           "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
                           "is_encoder_decoder", "add_cross_attention", "tie_word_embeddings", "pruned_heads",
                           "torchscript", "use_bfloat16", "tf_legacy_loss", "bos_token_id", "eos_token_id",
                           "pad_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params",
                           "cross_attention_hidden_size", "finetuning_task", "tokenizer_class", "prefix",
                           "is_decoder", "_attn_implementation_autoset"})
_VISION_READ = frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                          "num_channels", "image_size", "patch_size", "layer_norm_eps", "hidden_act",
                          # SigLIP's pooling head: loaded with the checkpoint, never run (LLaVA reads
                          # the layers' hidden states)
                          "vision_use_head",
                          # SmolVLM's releases repeat their processor's sizes here (and a training
                          # flag); its modelling code reads none of them
                          "max_image_size", "size", "use_base_siglip"})


# PaliGemma's releases write their image count into the vision config (checked against the
# encoder's patches) and a projector activation that neither transformers' nor vLLM's PaliGemma
# reads (its projector is one linear layer)
_PALIGEMMA_VISION_READ = _VISION_READ | {"num_image_tokens", "projector_hidden_act"}


@dataclass(frozen=True, slots=True)
class ImageEncoderConfig:
    """LLaVA's vision side: a CLIP or SigLIP vision transformer (the features of `feature_layers`,
    indices into its hidden states as transformers counts them, concatenated), then the projector."""

    encoder_type: str  # one of _VISION_MODEL_TYPES
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    feature_layers: tuple[int, ...]
    keep_first_feature: bool  # vision_feature_select_strategy "full" ("default" drops it)
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int
    # LLaVA-NeXT's "any resolution": the (height, width) an image may be resized to, a grid of
    # encoder-sized tiles read beside the whole image resized (empty: LLaVA 1.5, one tile)
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    # LLaVA-OneVision (vision_aspect_ratio "anyres_max_N"): an image's unpadded tile features
    # bilinearly scaled down to about N tiles' worth where they hold more (0: LLaVA-NeXT, never),
    # and in a prompt of several images each read whole only, its features and one newline
    anyres_max: int = 0
    # Gemma 3's projector: the last layer's features (after the post-layernorm) average-pooled to
    # this many (a square), RMS-normed and projected (0: LLaVA's two-layer projector)
    pooled_tokens: int = 0
    # Gemma 3: the token a chat template writes for an image (its start-of-image token), expanded
    # to `frame_text`, the start token, the features' placeholders, the end token, `frame_text`
    # (None: the template writes the placeholder token itself, expanded to the placeholders)
    start_token_id: int | None = None
    end_token_id: int | None = None
    frame_text: str = ""
    # vLLM's "mm prefix LM" (Gemma 3, PaliGemma): in a prompt's forward pass an image's
    # placeholders attend to each other both ways (and causally to what precedes), as transformers'
    # token_type_ids mask does with the image placeholders marked (PaliGemma's processor marks its
    # whole prompt; vLLM's, and this engine, the images: a cached image prefix then does not depend
    # on the text after it)
    bidirectional: bool = False
    # PaliGemma: the features are the last layer's (after the post-layernorm) through one linear
    # layer with a bias; the prompt is its processor's "<image>" per image (put at the start where
    # the prompt has none), its bos token after the last, the prompt's text, then a newline
    prefix_images: bool = False
    # Idefics3 / SmolVLM's connector: the last layer's features (after the post-layernorm)
    # pixel-shuffled by this factor and projected without a bias; each encoder input is one of an
    # image's tiles or the whole image, its own run of placeholders (0: not this form)
    pixel_shuffle: int = 0
    # Qwen2-VL: each `spatial_merge` x `spatial_merge` square of patches merged into one feature
    # (0: not this form); an image's patches are `temporal_patch` frames (a picture repeated) of
    # patch_size x patch_size pixels; the language model's M-RoPE splits each head's rotated pairs
    # into `mrope_section` parts turned by the temporal, height and width positions
    spatial_merge: int = 0
    temporal_patch: int = 0
    mrope_section: tuple[int, ...] = ()
    vision_rope_theta: float = 10000.0
    # Qwen2.5-VL: blocks attend within windows of window_size x window_size pixels (of merged
    # squares), but those of `full_attention_blocks` over the whole image
    window_size: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    # Qwen2-VL: the tokens around an image's placeholder in its prompts (vision start / end),
    # which a chat written in the "string" content format writes with it
    frame_token_ids: tuple[int, int] | None = None
    # Qwen3-VL: M-RoPE's sections interleaved (pair i turned by the height positions where
    # i % 3 == 1 and the width ones where i % 3 == 2, within their sections' spans; else temporal)
    mrope_interleaved: bool = False
    # Qwen3-VL: a learned square grid of this many patch position embeddings, bilinearly
    # resampled to each image's grid and added to its patch embeddings (0: none)
    position_embeddings: int = 0
    # Qwen3-VL's DeepStack: the vision blocks whose output states, merged by a merger of their
    # own, are added to the language model's hidden states at the image's placeholders after its
    # first, second, ... layer (an image's features carry them after its input embeddings)
    deepstack_blocks: tuple[int, ...] = ()
    # InternVL: the tokens (their text: the tokenizer has their ids) around the one run of
    # placeholders of all an image's tiles (its processor's `<img>`, `</img>`); its InternViT's
    # norms ("layer_norm" / "rms_norm"), q / k RMS norms (over all heads at once) and q / k / v biases
    tile_frame: tuple[str, str] = ()
    # Mistral 3 (Pixtral): an image of any size up to `image_size` on its longer edge, read whole;
    # its features a grid of merged patches whose placeholder rows each end with the first of these
    # tokens, the last row with the second (`[IMG_BREAK]`, `[IMG_END]`: their text, the tokenizer
    # has their ids); the projector's RMS norm's eps
    row_end_tokens: tuple[str, str] = ()
    projector_norm_eps: float = 1e-5
    # Mistral 3's projector: the features RMS-normed, each spatial_merge x spatial_merge square of
    # them merged by a linear layer, then the two-layer MLP (Pixtral-12B's LLaVA form: the MLP alone)
    patch_merger: bool = False
    vision_norm: str = "layer_norm"
    vision_qk_norm: bool = False
    vision_attention_bias: bool = True

    @property
    def mrope(self) -> bool:
        """Qwen2-VL's form: patches of any image size, multimodal rotary positions."""
        return bool(self.mrope_section)

    @property
    def row_breaks(self) -> bool:
        """Mistral 3's form: an image's placeholder rows ended by tokens of their own."""
        return bool(self.row_end_tokens)

    @property
    def feature_pixels(self) -> int:
        """Qwen-VL, Mistral 3: the pixels on a side of the square one feature reads (a merged patch square)."""
        return self.patch_size * self.spatial_merge

    def feature_grid(self, height: int, width: int) -> tuple[int, int]:
        """Mistral 3: the (rows, columns) of features of an image its processor resized to this size."""
        return height // self.feature_pixels, width // self.feature_pixels

    def placeholder_span(self, height: int, width: int) -> int:
        """Mistral 3: the prompt tokens of such an image: each row of features and its end token."""
        rows, columns = self.feature_grid(height, width)
        return rows * (columns + 1)

    @property
    def patch_values(self) -> int:
        """Qwen2-VL: the pixel values of one patch (channels x frames x patch_size²)."""
        return self.num_channels * self.temporal_patch * self.patch_size ** 2

    @property
    def windowed(self) -> bool:
        """Qwen2.5-VL's vision transformer (window attention, RMS norms, gated MLPs)."""
        return self.window_size > 0

    @property
    def learned_positions(self) -> bool:
        """Qwen3-VL's vision transformer (learned position grid, biased patch embedding)."""
        return self.position_embeddings > 0

    def merged_tokens(self, rows: int, columns: int) -> int:
        """Qwen2-VL: the placeholders of an image of rows x columns patches (one per merged square)."""
        return rows * columns // self.spatial_merge ** 2

    @property
    def framed(self) -> bool:
        """Gemma 3's form: an image's placeholders framed by start / end tokens written around them
        (its pan-and-scan crops each so framed, after the whole image)."""
        return self.start_token_id is not None

    @property
    def inputs_per_image_vary(self) -> bool:
        """An image may be several encoder inputs, each its own run of placeholders (tiles,
        Gemma 3's pan-and-scan crops): the engine core bounds their count by the prompt's length."""
        return self.tiled or self.framed

    @property
    def tiled(self) -> bool:
        """An image is several encoder inputs, each its own run of placeholders (Idefics3 / SmolVLM;
        InternVL's runs adjacent, framed once per image: `tile_frame`)."""
        return self.pixel_shuffle > 0

    @property
    def reads_final_state(self) -> bool:
        """The features are the encoder's last hidden state after its post-layernorm (Gemma 3,
        Idefics3 / SmolVLM, PaliGemma), not the raw hidden states of `feature_layers` (LLaVA)."""
        return bool(self.pooled_tokens or self.pixel_shuffle or self.prefix_images)

    @property
    def prompt_token_id(self) -> int:
        """The token a prompt carries per image before expansion (what a chat template writes)."""
        return self.image_token_id if self.start_token_id is None else self.start_token_id

    @property
    def any_resolution(self) -> bool:
        return bool(self.grid_pinpoints)

    def tile_grid(self, height: int, width: int) -> tuple[int, int]:
        """LLaVA-NeXT: the (rows, columns) of tiles an image of this size is read as (the
        pinpoint transformers' processor resizes it to, in encoder-sized tiles)."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution((height, width), [list(p) for p in self.grid_pinpoints])
        return best_height // self.image_size, best_width // self.image_size

    def unpadded_features(self, height: int, width: int) -> tuple[int, int]:
        """LLaVA-NeXT: the (rows, columns) of tile features left once the padding the resize added
        around an image of this size is cut away (transformers' unpad_image)."""
        rows, columns = self.tile_grid(height, width)
        side = self.image_size // self.patch_size
        current_height, current_width = rows * side, columns * side
        if width / height > current_width / current_height:
            new_height = int(round(height * (current_width / width), 7))
            current_height -= (current_height - new_height) // 2 * 2
        else:
            new_width = int(round(width * (current_height / height), 7))
            current_width -= (current_width - new_width) // 2 * 2
        return current_height, current_width

    def packed_features(self, height: int, width: int) -> tuple[int, int]:
        """LLaVA-NeXT's `unpadded_features`; LLaVA-OneVision's scaled down (by the ratio of their
        area to anyres_max tiles', floored, where it exceeds 1.1: transformers' pack_image_features)."""
        rows, columns = self.unpadded_features(height, width)
        if self.anyres_max:
            side = self.image_size // self.patch_size
            ratio = math.sqrt(rows * columns / (self.anyres_max * side ** 2))
            if ratio > 1.1:
                rows, columns = int(rows // ratio), int(columns // ratio)
        return rows, columns

    def whole_only(self, alone: bool) -> bool:
        """LLaVA-OneVision reads the images of a prompt with several whole only (its processor's
        and model's rule: no tiles, the features and one newline)."""
        return bool(self.anyres_max) and not alone

    def tokens_for(self, height: int, width: int, alone: bool = True) -> int:
        """An image's placeholder tokens (one per feature): LLaVA 1.5's fixed count; LLaVA-NeXT's
        whole-image features, then each unpadded row of tile features and its newline (`alone`:
        the image is its prompt's only one)."""
        if not self.any_resolution:
            return self.tokens_per_image
        if self.whole_only(alone):
            return self.tokens_per_image + 1
        rows, columns = self.packed_features(height, width)
        return self.tokens_per_image + rows * (columns + 1)

    def tiles_for(self, height: int, width: int, alone: bool = True) -> int:
        """The encoder inputs of one image: 1, or LLaVA-NeXT's whole image and its tiles."""
        if not self.any_resolution or self.whole_only(alone):
            return 1
        rows, columns = self.tile_grid(height, width)
        return 1 + rows * columns

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def has_cls(self) -> bool:
        return self.encoder_type == "clip_vision_model"

    @property
    def num_positions(self) -> int:
        return self.num_patches + int(self.has_cls)

    @property
    def tokens_per_image(self) -> int:
        """An image's placeholder tokens in the prompt: one per feature it becomes."""
        if self.pooled_tokens:
            return self.pooled_tokens
        if self.pixel_shuffle:
            return self.num_patches // self.pixel_shuffle ** 2
        return self.num_positions - int(not self.keep_first_feature)


def read_image_encoder(cfg: Mapping[str, Any]) -> ImageEncoderConfig:
    """The vision side of a multimodal config.json (the outer config), read as transformers'
    class for it reads it. Raises ValueError naming what is not implemented."""
    from vllm_lite.multimodal_checkpoints import transformers_config

    architecture = cfg["architectures"][0]
    if architecture not in IMAGE_ARCHITECTURES:
        raise ValueError(f"image inputs of {architecture} are not implemented (implemented: "
                         f"{', '.join(IMAGE_ARCHITECTURES)} with a CLIP or SigLIP vision encoder)")
    outer = transformers_config({name: value for name, value in cfg.items() if name != "quantization_config"})
    if quantized_vision(cfg):
        raise ValueError("a quantized vision encoder is not implemented for image inputs")
    if architecture in _QWEN_VL_ARCHITECTURES:
        return _qwen_vl_encoder(outer, _read_vision(outer, _QWEN_VL_VISION_READ))
    tiled = architecture in ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
    vision = _read_vision(outer, _vision_encoders(architecture))
    if architecture == "Gemma3ForConditionalGeneration":
        return _gemma3_encoder(outer, vision)
    if architecture == "PaliGemmaForConditionalGeneration":
        return _paligemma_encoder(outer, vision)
    if architecture == "InternVLForConditionalGeneration":
        return _internvl_encoder(outer, vision)
    if architecture == "Mistral3ForConditionalGeneration" or vision["model_type"] == "pixtral":
        return _pixtral_encoder(outer, vision, merged=architecture == "Mistral3ForConditionalGeneration")
    if tiled:
        return _tiled_encoder(outer, vision)
    if outer.projector_hidden_act not in PLAIN_ACTIVATIONS:
        raise ValueError(f"projector_hidden_act={outer.projector_hidden_act!r} is not implemented")
    strategy = outer.vision_feature_select_strategy
    if strategy not in _SELECT_STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not implemented "
                         f"(implemented: {', '.join(_SELECT_STRATEGIES)})")
    layers = outer.vision_feature_layer
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    depth = vision["num_hidden_layers"]
    if not layers or any(not isinstance(layer, int) or not -depth - 1 <= layer <= depth for layer in layers):
        raise ValueError(f"vision_feature_layer={outer.vision_feature_layer!r} names no hidden state of the "
                         f"{depth}-layer vision encoder")
    pinpoints = tuple(tuple(p) for p in getattr(outer, "image_grid_pinpoints", None) or ())
    any_resolution = architecture in ("LlavaNextForConditionalGeneration", "LlavaOnevisionForConditionalGeneration")
    if any_resolution:
        if (vision["model_type"], strategy) not in (("clip_vision_model", "default"), ("siglip_vision_model", "full")):
            raise ValueError(f"image inputs of {architecture} are implemented with a CLIP encoder and "
                             f"vision_feature_select_strategy='default', or a SigLIP one and 'full' (its tiles' "
                             f"features form a square grid), got {vision['model_type']} and {strategy!r}")
        side = vision["image_size"]
        if not pinpoints or any(len(p) != 2 or p[0] % side or p[1] % side or min(p) <= 0 for p in pinpoints):
            raise ValueError(f"image_grid_pinpoints={getattr(outer, 'image_grid_pinpoints', None)!r}: each must be "
                             f"a (height, width) in whole tiles of the encoder's {side} pixels")
        if getattr(outer, "use_image_newline_parameter", True) is False:
            raise ValueError("use_image_newline_parameter=False is not implemented (transformers' LLaVA-NeXT "
                             "always reads its image_newline)")
    anyres_max = _anyres_max(outer) if architecture == "LlavaOnevisionForConditionalGeneration" else 0
    return ImageEncoderConfig(
        encoder_type=vision["model_type"], hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_layers=depth, num_heads=vision["num_attention_heads"], num_channels=vision["num_channels"],
        image_size=vision["image_size"], patch_size=vision["patch_size"], layer_norm_eps=vision["layer_norm_eps"],
        hidden_act=vision["hidden_act"], feature_layers=layers, keep_first_feature=strategy == "full",
        projector_act=outer.projector_hidden_act, projector_bias=bool(getattr(outer, "multimodal_projector_bias", True)),
        text_hidden_size=outer.get_text_config().hidden_size, image_token_id=outer.image_token_id,
        grid_pinpoints=pinpoints if any_resolution else (), anyres_max=anyres_max)


def _vision_encoders(architecture: str) -> dict[str, frozenset[str]]:
    """The vision encoders (model types, each with the fields read of it) implemented for an
    architecture's image inputs (besides Qwen's)."""
    if architecture == "PaliGemmaForConditionalGeneration":
        return {"siglip_vision_model": _PALIGEMMA_VISION_READ}
    if architecture == "InternVLForConditionalGeneration":
        return {"internvl_vision": _INTERNVL_VISION_READ}
    if architecture == "Mistral3ForConditionalGeneration":
        return {"pixtral": _PIXTRAL_VISION_READ}
    if architecture in ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"):
        return dict.fromkeys(_TILE_VISION_MODEL_TYPES, _VISION_READ)
    encoders = dict.fromkeys(_VISION_MODEL_TYPES, _VISION_READ)
    if architecture == "LlavaForConditionalGeneration":  # (Pixtral-12B's)
        encoders["pixtral"] = _PIXTRAL_VISION_READ
    return encoders


def _anyres_max(outer: Any) -> int:
    """LLaVA-OneVision's vision_aspect_ratio "anyres_max_N": N (its only form transformers reads)."""
    aspect = getattr(outer, "vision_aspect_ratio", None)
    count = aspect.removeprefix("anyres_max_") if isinstance(aspect, str) else ""
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"vision_aspect_ratio={aspect!r} is not implemented (anyres_max_N is)")
    return int(count)


def _read_vision(outer: Any, read: Mapping[str, frozenset[str]]) -> dict[str, Any]:
    """The outer config's vision_config, refused by name where its encoder is not implemented
    (`read`: the vision model types implemented, each with the fields read of it)."""
    vision = outer.vision_config.to_dict()
    if vision.get("model_type") not in read:
        raise ValueError(f"vision_config.model_type {vision.get('model_type')!r} is not implemented for image "
                         f"inputs (implemented: {', '.join(read)})")
    unknown = sorted(name for name in vision if name not in read[vision["model_type"]] | _VISION_INERT)
    if unknown:
        raise ValueError(f"vision_config fields {unknown} are not implemented for image inputs")
    if vision["hidden_act"] not in PLAIN_ACTIVATIONS:
        raise ValueError(f"vision_config.hidden_act={vision['hidden_act']!r} is not implemented")
    return vision


def _gemma3_encoder(outer: Any, vision: dict[str, Any]) -> ImageEncoderConfig:
    """Gemma 3's vision side (transformers' Gemma3MultiModalProjector): SigLIP's last hidden
    state, its patch grid average-pooled to mm_tokens_per_image features."""
    if vision["model_type"] != "siglip_vision_model":
        raise ValueError(f"image inputs of Gemma3ForConditionalGeneration are implemented with a SigLIP encoder, "
                         f"got vision_config.model_type={vision['model_type']!r}")
    side = vision["image_size"] // vision["patch_size"]
    tokens = outer.mm_tokens_per_image
    per_side = int(round(tokens ** 0.5)) if isinstance(tokens, int) and tokens > 0 else 0
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(f"mm_tokens_per_image={tokens!r} must be a square whose side divides the encoder's "
                         f"{side} x {side} patches (they are average-pooled to it)")
    return _last_layer_encoder(outer, vision, pooled_tokens=tokens, start_token_id=outer.boi_token_id,
                               end_token_id=outer.eoi_token_id, frame_text="\n\n", bidirectional=True)


def _paligemma_encoder(outer: Any, vision: dict[str, Any]) -> ImageEncoderConfig:
    """PaliGemma's vision side (transformers' PaliGemmaMultiModalProjector): SigLIP's last hidden
    state, one feature per patch, through one linear layer with a bias; its images' placeholders
    go before the prompt (`prefix_images`)."""
    if vision["model_type"] != "siglip_vision_model":
        raise ValueError(f"image inputs of PaliGemmaForConditionalGeneration are implemented with a SigLIP encoder, "
                         f"got vision_config.model_type={vision['model_type']!r}")
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    if vision.get("num_image_tokens", patches) != patches:
        raise ValueError(f"vision_config.num_image_tokens={vision['num_image_tokens']!r} must be the encoder's "
                         f"{patches} patches (one feature each)")
    text_hidden_size = outer.get_text_config().hidden_size
    if outer.projection_dim != text_hidden_size:
        raise ValueError(f"projection_dim={outer.projection_dim!r} must equal text_config.hidden_size="
                         f"{text_hidden_size} (the projector's outputs are the language model's input embeddings)")
    return _last_layer_encoder(outer, vision, projector_bias=True, bidirectional=True, prefix_images=True)


def _tiled_encoder(outer: Any, vision: dict[str, Any]) -> ImageEncoderConfig:
    """Idefics3 / SmolVLM's vision side (transformers' SmolVLMConnector): the last hidden state of
    each tile pixel-shuffled by scale_factor, projected."""
    side = vision["image_size"] // vision["patch_size"]
    scale = outer.scale_factor
    if not (isinstance(scale, int) and scale >= 1 and side % scale == 0):
        raise ValueError(f"scale_factor={scale!r} must be a positive integer dividing the encoder's {side} x {side} "
                         "patches (they are pixel-shuffled by it)")
    return _last_layer_encoder(outer, vision, pixel_shuffle=scale)


def _last_layer_encoder(outer: Any, vision: dict[str, Any], **form: Any) -> ImageEncoderConfig:
    """A SigLIP-shaped encoder whose features are its last layer's, after its post-layernorm (Gemma
    3, PaliGemma, Idefics3 / SmolVLM), with `form`: the fields of its projector and prompt form (a
    projector without a bias unless it says otherwise)."""
    return ImageEncoderConfig(
        encoder_type="siglip_vision_model", hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_layers=vision["num_hidden_layers"],
        num_heads=vision["num_attention_heads"], num_channels=vision["num_channels"],
        image_size=vision["image_size"], patch_size=vision["patch_size"], layer_norm_eps=vision["layer_norm_eps"],
        hidden_act=vision["hidden_act"], feature_layers=(vision["num_hidden_layers"],), keep_first_feature=True,
        projector_act="", text_hidden_size=outer.get_text_config().hidden_size, image_token_id=outer.image_token_id,
        **{"projector_bias": False, **form})


def _internvl_encoder(outer: Any, vision: dict[str, Any]) -> ImageEncoderConfig:
    """InternVL's vision side (transformers' InternVLVisionModel and InternVLMultiModalProjector):
    an image is its processor's tiles of the encoder's size, each read by InternViT, its patch
    features (the CLS one dropped) pixel-shuffled by 1 / downsample_ratio and projected; all its
    tiles' placeholders one run between `<img>` and `</img>`."""
    image_size, patch_size = _square(vision, "image_size"), _square(vision, "patch_size")
    if image_size % patch_size:
        raise ValueError(f"vision_config.image_size={image_size} must be a multiple of patch_size={patch_size}")
    if vision["norm_type"] not in _INTERNVL_NORMS:
        raise ValueError(f"vision_config.norm_type={vision['norm_type']!r} is not implemented "
                         f"(implemented: {', '.join(_INTERNVL_NORMS)})")
    if not vision["use_absolute_position_embeddings"]:
        raise ValueError("vision_config.use_absolute_position_embeddings=False is not implemented")
    if not vision["use_mean_pooling"]:  # (transformers then norms the last hidden state)
        raise ValueError("vision_config.use_mean_pooling=False is not implemented")
    side, ratio = image_size // patch_size, outer.downsample_ratio
    scale = round(1 / ratio) if isinstance(ratio, (int, float)) and ratio > 0 else 0
    if scale < 1 or scale * ratio != 1 or side % scale:
        raise ValueError(f"downsample_ratio={ratio!r} must be 1 / n for an n dividing the encoder's {side} x {side} "
                         "patches (they are pixel-shuffled by it)")
    layer, strategy = outer.vision_feature_layer, outer.vision_feature_select_strategy
    depth = vision["num_hidden_layers"]
    if not isinstance(layer, int) or not -depth - 1 <= layer <= depth:
        raise ValueError(f"vision_feature_layer={layer!r} must name one hidden state of the {depth}-layer encoder")
    if strategy != "default":
        raise ValueError(f"vision_feature_select_strategy={strategy!r} is not implemented for InternVL (its CLS "
                         "feature is dropped: 'default')")
    if outer.projector_hidden_act not in PLAIN_ACTIVATIONS:
        raise ValueError(f"projector_hidden_act={outer.projector_hidden_act!r} is not implemented")
    tokens = (side // scale) ** 2
    if outer.image_seq_length != tokens:
        raise ValueError(f"image_seq_length={outer.image_seq_length!r} must be a tile's {tokens} features "
                         f"({side} x {side} patches shuffled by {scale})")
    return ImageEncoderConfig(
        encoder_type="internvl_vision", hidden_size=vision["hidden_size"],
        intermediate_size=vision["intermediate_size"], num_layers=depth,
        num_heads=vision["num_attention_heads"], num_channels=vision["num_channels"], image_size=image_size,
        patch_size=patch_size, layer_norm_eps=vision["layer_norm_eps"], hidden_act=vision["hidden_act"],
        feature_layers=(layer,), keep_first_feature=False, projector_act=outer.projector_hidden_act,
        projector_bias=True, text_hidden_size=outer.get_text_config().hidden_size,
        image_token_id=outer.image_token_id, pixel_shuffle=scale, tile_frame=("<img>", "</img>"),
        vision_norm=vision["norm_type"], vision_qk_norm=bool(vision["use_qk_norm"]),
        vision_attention_bias=bool(vision["attention_bias"]))


def _pixtral_encoder(outer: Any, vision: dict[str, Any], merged: bool) -> ImageEncoderConfig:
    """Mistral 3's vision side (transformers' PixtralVisionModel and Mistral3MultiModalProjector):
    an image of any size read whole by Pixtral (2-D rotary positions), the features of one layer
    RMS-normed, each spatial_merge x spatial_merge square of them merged by a linear layer, then
    projected; its placeholders rows of [IMG], each ended by [IMG_BREAK], the last by [IMG_END].
    Not `merged`: Pixtral-12B's (LlavaForConditionalGeneration with a Pixtral encoder): every
    patch a feature, projected by LLaVA's MLP alone."""
    heads, width = vision["num_attention_heads"], vision["hidden_size"]
    head_dim = vision.get("head_dim") or width // heads
    if head_dim * heads != width or head_dim % 4:
        raise ValueError(f"vision_config: head_dim={head_dim} must be hidden_size / num_attention_heads "
                         f"({width} / {heads}) and divisible by 4 (its 2-D rotary)")
    rope = dict(vision.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
        raise ValueError(f"vision_config.rope_parameters={rope!r} is not implemented (axial rope with a rope_theta)")
    merge, patch = outer.spatial_merge_size if merged else 1, vision["patch_size"]
    if not merged and outer.vision_feature_select_strategy != "full":
        raise ValueError(f"vision_feature_select_strategy={outer.vision_feature_select_strategy!r} is not implemented "
                         "for a Pixtral encoder (it has no CLS feature: 'full')")
    if not (isinstance(merge, int) and merge >= 1 and isinstance(patch, int) and patch >= 1):
        raise ValueError(f"spatial_merge_size={merge!r}, vision_config.patch_size={patch!r}: positive integers needed")
    layer, depth = outer.vision_feature_layer, vision["num_hidden_layers"]
    if not isinstance(layer, int) or not -depth - 1 <= layer <= depth:
        raise ValueError(f"vision_feature_layer={layer!r} is not implemented: one hidden state of the "
                         f"{depth}-layer encoder (several concatenated are not)")
    if outer.projector_hidden_act not in PLAIN_ACTIVATIONS:
        raise ValueError(f"projector_hidden_act={outer.projector_hidden_act!r} is not implemented")
    text = outer.get_text_config()
    return ImageEncoderConfig(
        encoder_type="pixtral", hidden_size=width, intermediate_size=vision["intermediate_size"], num_layers=depth,
        num_heads=heads, num_channels=vision["num_channels"], image_size=vision["image_size"], patch_size=patch,
        layer_norm_eps=1e-5, hidden_act=vision["hidden_act"], feature_layers=(layer,), keep_first_feature=True,
        projector_act=outer.projector_hidden_act, projector_bias=bool(outer.multimodal_projector_bias),
        text_hidden_size=text.hidden_size, image_token_id=outer.image_token_index, spatial_merge=merge,
        vision_rope_theta=float(rope.get("rope_theta", 10000.0)), row_end_tokens=("[IMG_BREAK]", "[IMG_END]"),
        projector_norm_eps=float(text.rms_norm_eps), patch_merger=merged)


def _square(vision: dict[str, Any], name: str) -> int:
    """A size given as an int or an (equal) pair."""
    value = vision[name]
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int) or sides[0] < 1:
        raise ValueError(f"vision_config.{name}={value!r} must be a positive square size")
    return sides[0]


def _qwen_vl_encoder(outer: Any, vision: dict[str, Any]) -> ImageEncoderConfig:
    """Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision side (transformers' Qwen2VisionTransformerPretrainedModel /
    Qwen2_5_VisionTransformerPretrainedModel / Qwen3VLVisionModel and their patch mergers) and the
    language model's M-RoPE sections (its text config's rope parameters)."""
    if vision.get("in_chans", vision["in_channels"]) != vision["in_channels"] or \
            vision.get("spatial_patch_size", vision["patch_size"]) != vision["patch_size"]:
        raise ValueError("vision_config: in_chans / spatial_patch_size disagree with in_channels / patch_size")
    rope = dict(vision.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial" or set(rope) - {"rope_type", "rope_theta"}:
        raise ValueError(f"vision_config.rope_parameters={rope!r} is not implemented (axial rope with a rope_theta)")
    text = outer.get_text_config()
    windowed = vision["model_type"] == "qwen2_5_vl_vision"
    qwen3 = vision["model_type"] in ("qwen3_vl_vision", "qwen3_vl_moe_vision")
    output = "out_hidden_size" if windowed or qwen3 else "hidden_size"
    if vision[output] != text.hidden_size:
        raise ValueError(f"vision_config.{output}={vision[output]} must be the language model's "
                         f"hidden_size {text.hidden_size} (the merger's output feeds it)")
    for name in ("patch_size", "temporal_patch_size"):
        if not (isinstance(vision[name], int) and vision[name] >= 1):
            raise ValueError(f"vision_config.{name}={vision[name]!r} must be a positive integer (square patches)")
    merge, heads = vision["spatial_merge_size"], vision["num_heads"]
    embed_dim = vision["hidden_size" if windowed or qwen3 else "embed_dim"]
    if not (isinstance(merge, int) and merge >= 1) or embed_dim % heads or (embed_dim // heads) % 4:
        raise ValueError(f"vision_config: spatial_merge_size={merge!r}, embed_dim={embed_dim}, num_heads={heads}: "
                         "a positive merge size and a head size divisible by 4 (its 2-D rotary) are needed")
    text_rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})
    section = tuple(text_rope.get("mrope_section") or (_QWEN3_MROPE_SECTION if qwen3 else _DEFAULT_MROPE_SECTION))
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section={list(section)!r} must be three parts of the language model's "
                         f"{head_dim // 2} rotated pairs")
    # (transformers' Qwen3-VL always interleaves, its Qwen2-VL / Qwen2.5-VL never: a config that
    # says otherwise is refused rather than read one way)
    if text_rope.get("mrope_interleaved", qwen3) != qwen3:
        raise ValueError(f"rope_parameters.mrope_interleaved={text_rope['mrope_interleaved']!r} is not implemented "
                         f"for {vision['model_type']} (its sections are {'' if qwen3 else 'not '}interleaved)")
    window, full_blocks = (vision["window_size"], tuple(vision["fullatt_block_indexes"])) if windowed else (0, ())
    positions, deepstack = _qwen3_vl_extras(vision, text.num_hidden_layers) if qwen3 else (0, ())
    unit = merge * vision["patch_size"]
    if windowed and not (isinstance(window, int) and window >= unit and window % unit == 0):
        raise ValueError(f"vision_config.window_size={window!r} must be a multiple of a merged square's {unit} pixels")
    return ImageEncoderConfig(
        encoder_type=vision["model_type"], hidden_size=embed_dim,
        intermediate_size=vision["intermediate_size"] if windowed or qwen3 else int(embed_dim * vision["mlp_ratio"]),
        num_layers=vision["depth"], num_heads=heads, num_channels=vision["in_channels"], image_size=0,
        patch_size=vision["patch_size"], layer_norm_eps=1e-6, hidden_act=vision["hidden_act"],
        feature_layers=(vision["depth"],), keep_first_feature=True, projector_act="gelu", projector_bias=True,
        text_hidden_size=text.hidden_size, image_token_id=outer.image_token_id, spatial_merge=merge,
        temporal_patch=vision["temporal_patch_size"], mrope_section=section,
        vision_rope_theta=float(rope.get("rope_theta", 10000.0)), window_size=window, full_attention_blocks=full_blocks,
        frame_token_ids=(outer.vision_start_token_id, outer.vision_end_token_id), mrope_interleaved=qwen3,
        position_embeddings=positions, deepstack_blocks=deepstack)


def _qwen3_vl_extras(vision: dict[str, Any], text_layers: int) -> tuple[int, tuple[int, ...]]:
    """Qwen3-VL's learned position grid (its size, a square) and DeepStack blocks (each a vision
    block, at most one per language-model layer)."""
    positions = vision["num_position_embeddings"]
    if not (isinstance(positions, int) and positions > 0 and math.isqrt(positions) ** 2 == positions):
        raise ValueError(f"vision_config.num_position_embeddings={positions!r} must be a square (a grid of positions)")
    deepstack = tuple(vision["deepstack_visual_indexes"] or ())
    if any(not isinstance(block, int) or not 0 <= block < vision["depth"] for block in deepstack) or \
            len(set(deepstack)) != len(deepstack) or len(deepstack) > text_layers:
        raise ValueError(f"vision_config.deepstack_visual_indexes={list(deepstack)!r} must name distinct blocks of the "
                         f"{vision['depth']}-block vision transformer, at most one per language-model layer "
                         f"({text_layers})")
    return positions, deepstack


# what the engine gives the image processor itself
_ENGINE_PROCESSOR_ARGUMENTS = frozenset({"images", "text", "videos", "audio", "return_tensors", "return_row_col_info"})


def check_processor_kwargs(kwargs: Any, name: str) -> dict[str, Any] | None:
    """vLLM's mm_processor_kwargs: keyword arguments of the model's image processor (None or {}:
    none; the processor itself refuses those it does not take, when it runs)."""
    if kwargs is None:
        return None
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise ValueError(f"{name} must be a dict of the image processor's keyword arguments, got {kwargs!r:.200}")
    taken = sorted(set(kwargs) & _ENGINE_PROCESSOR_ARGUMENTS)
    if taken:
        raise ValueError(f"{name}: {taken} are the engine's to give the image processor")
    return dict(kwargs) or None


def quantized_vision(cfg: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's quantization covers the vision side (its ignore lists usually
    leave the vision tower out; a quantized checkpoint that says nothing is taken as covering it)."""
    quantization = cfg.get("quantization_config")
    if not quantization:
        return False
    skipped = [*(quantization.get("ignore") or ()), *(quantization.get("modules_to_not_convert") or ()),
               *(quantization.get("llm_int8_skip_modules") or ())]
    return not any("vision" in str(name) for name in skipped)


def images_per_prompt(limit_mm_per_prompt: Mapping[str, Any] | None, language_model_only: bool,
                      architecture: str, refusal: str) -> int:
    """The most images a prompt may carry (vLLM's limit_mm_per_prompt; 0: text only). Raises
    ValueError where a limit above 0 is asked for inputs that cannot be taken (`refusal`: why this
    checkpoint takes no images, "" where it does)."""
    if not isinstance(limit_mm_per_prompt or {}, Mapping):  # (before dict(), whose own error names nothing)
        raise ValueError(f"limit_mm_per_prompt must be a dict of modality -> count, got {limit_mm_per_prompt!r}")
    limits = dict(limit_mm_per_prompt or {})
    counts = {modality: limit.get("count") if isinstance(limit, Mapping) else limit
              for modality, limit in limits.items()}
    supported = SUPPORTED_IMAGES_PER_PROMPT.get(architecture, DEFAULT_IMAGES_PER_PROMPT)
    for modality, count in counts.items():
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise ValueError(f"limit_mm_per_prompt: {modality}={limits[modality]!r}: the count must be an integer >= 0")
        if count == 0:
            continue
        if modality != "image":
            raise ValueError(f"limit_mm_per_prompt: {modality}={limits[modality]!r}: multimodal inputs are not "
                             f"implemented for {modality} (image inputs of {', '.join(IMAGE_ARCHITECTURES)} are); "
                             "give 0")
        if language_model_only:
            raise ValueError(f"limit_mm_per_prompt: image={limits[modality]!r} with language_model_only=True: "
                             "the language model alone takes no images")
        if refusal:
            raise ValueError(f"limit_mm_per_prompt: image={limits[modality]!r}: multimodal inputs are not "
                             f"implemented for {architecture or 'this model'} ({refusal}); give 0 for every "
                             "modality, or language_model_only=True")
        if count > supported:
            raise ValueError(f"limit_mm_per_prompt: image={limits[modality]!r}: {architecture} takes at most "
                             f"{supported} image(s) per prompt")
    if language_model_only or refusal:
        return 0
    return counts.get("image", supported)
