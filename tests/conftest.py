"""Shared fixtures: tiny random-weight HF checkpoints built once per session.

All model fixtures return the checkpoint directory (``pathlib.Path``) holding
config.json, generation_config.json, safetensors weights and the tokenizer.
"""

from __future__ import annotations

import json
import os

# Must happen before torch/triton are imported anywhere.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from hf_reference import build_prompts, build_tiny_model, build_tiny_multimodal_model, build_tokenizer  # noqa: E402

torch.set_num_threads(1)
hf_logging.disable_progress_bar()

LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _build(factory: pytest.TempPathFactory, name: str, arch: str, **kwargs) -> Path:
    return build_tiny_model(factory.mktemp(name), arch, **kwargs)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, GQA 4 q-heads / 2 kv-heads, untied lm_head, no attention bias."""
    return _build(tmp_path_factory, "tiny_llama", "llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llama_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama, MQA 4 / 1, tied embeddings, attention_bias=True (q/k/v/o biases)."""
    return _build(
        tmp_path_factory,
        "tiny_llama_tied",
        "llama",
        tie_word_embeddings=True,
        attention_bias=True,
        num_kv_heads=1,
    )


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2, GQA 4 / 2, untied, q/k/v bias (no o_proj bias)."""
    return _build(tmp_path_factory, "tiny_qwen2", "qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, GQA 4 / 2, tied, q_norm/k_norm, head_dim=32 != hidden/heads (16)."""
    return _build(
        tmp_path_factory, "tiny_qwen3", "qwen3", tie_word_embeddings=True, head_dim=32
    )


@pytest.fixture(scope="session")
def tiny_thinking_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen3's shape with a tokenizer that has `<think>` / `</think>` (tokens 1000, 1001)."""
    from transformers import AutoTokenizer

    out = build_tiny_model(tmp_path_factory.mktemp("tiny_thinking_qwen3"), "qwen3", tie_word_embeddings=True,
                           head_dim=32, extra_config={"vocab_size": 1002})
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same config and weights as ``tiny_llama``, split into ~14 safetensors shards
    listed in model.safetensors.index.json."""
    return _build(
        tmp_path_factory,
        "tiny_llama_sharded",
        "llama",
        tie_word_embeddings=False,
        max_shard_size="20KB",
    )


@pytest.fixture(scope="session")
def tiny_llama3_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_llama`` weights plus llama3 rope scaling (factor 8, original max
    positions 64); ignoring the scaling changes the greedy output."""
    return _build(
        tmp_path_factory,
        "tiny_llama3_rope",
        "llama",
        tie_word_embeddings=False,
        rope_scaling=dict(LLAMA3_ROPE_SCALING),
    )


@pytest.fixture(scope="session")
def tiny_models(
    tiny_llama: Path, tiny_llama_tied: Path, tiny_qwen2: Path, tiny_qwen3: Path
) -> dict[str, Path]:
    """The four main tiny checkpoints by fixture name, for parametrized parity tests."""
    return {
        "tiny_llama": tiny_llama,
        "tiny_llama_tied": tiny_llama_tied,
        "tiny_qwen2": tiny_qwen2,
        "tiny_qwen3": tiny_qwen3,
    }


@pytest.fixture(scope="session")
def _prompt_ids(tiny_tokenizer_dir: Path) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(ids) for ids in build_prompts(tiny_tokenizer_dir))


@pytest.fixture
def prompts_token_ids(_prompt_ids: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """8 deterministic prompts of 3, 7, 12, 20, 33, 50, 64 and 90 tokens (fresh lists per test)."""
    return [list(ids) for ids in _prompt_ids]


@pytest.fixture(scope="session")
def tiny_mistral_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral, GQA 4 / 2, untied, sliding_window=8 on every layer: prompts of 12+ tokens
    attend differently from full causal attention."""
    return _build(tmp_path_factory, "tiny_mistral_window", "mistral", tie_word_embeddings=False,
                  extra_config={"sliding_window": 8})


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixtral, 4 experts, top-2 (always renormalised), GQA 4 / 2."""
    return _build(tmp_path_factory, "tiny_mixtral", "mixtral", tie_word_embeddings=False,
                  extra_config={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None})


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE, 4 experts of width 32, top-2 without renormalisation (norm_topk_prob False);
    layer 0 dense (mlp_only_layers), layer 1 sparse; qk-norm, head_dim 32."""
    return _build(tmp_path_factory, "tiny_qwen3_moe", "qwen3_moe", tie_word_embeddings=False, head_dim=32,
                  extra_config={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "norm_topk_prob": False, "mlp_only_layers": [0]})


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2: local (window 8) then global layer, attention soft cap 3 and final soft cap 5
    (the final cap changes logprobs, never a greedy token), query_pre_attn_scalar 24 != head_dim
    16. Untied: tied random embeddings scaled by sqrt(hidden) make greedy output one token."""
    return _build(tmp_path_factory, "tiny_gemma2", "gemma2", tie_word_embeddings=False,
                  extra_config={"sliding_window": 8, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0})


GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}}


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 text: q/k norms, local (window 8, rope base 1e4) then global layer (base 1e6,
    linear scaling 4), final soft cap 5, head_dim 32, untied (as tiny_gemma2)."""
    return _build(tmp_path_factory, "tiny_gemma3", "gemma3", tie_word_embeddings=False, head_dim=32,
                  extra_config={"sliding_window": 8, "query_pre_attn_scalar": 32,
                                "final_logit_softcapping": 5.0, "rope_parameters": GEMMA3_ROPE,
                                "layer_types": ["sliding_attention", "full_attention"]})


def _build_multimodal(factory: pytest.TempPathFactory, name: str, architecture: str, text_arch: str,
                      **kwargs) -> Path:
    return build_tiny_multimodal_model(factory.mktemp(name), architecture, text_arch, **kwargs)


@pytest.fixture(scope="session")
def tiny_gemma3_mm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma3ForConditionalGeneration (Gemma 3 4B and up): a tiny SigLIP encoder and projector
    beside tiny_gemma3's language model (local then global layer, linear scaling), tied."""
    return _build_multimodal(tmp_path_factory, "tiny_gemma3_mm", "Gemma3ForConditionalGeneration", "gemma3",
                             tie_word_embeddings=True, head_dim=32,
                             text_extra={"sliding_window": 8, "query_pre_attn_scalar": 32,
                                         "rope_parameters": GEMMA3_ROPE,
                                         "layer_types": ["sliding_attention", "full_attention"]})


@pytest.fixture(scope="session")
def tiny_mistral3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2): Pixtral encoder, Mistral decoder."""
    return _build_multimodal(tmp_path_factory, "tiny_mistral3", "Mistral3ForConditionalGeneration", "mistral",
                             tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LlavaForConditionalGeneration (LLaVA 1.5): CLIP encoder, Llama decoder."""
    return _build_multimodal(tmp_path_factory, "tiny_llava", "LlavaForConditionalGeneration", "llama",
                             tie_word_embeddings=False)


@pytest.fixture(scope="session")
def image_host() -> Iterator[str]:
    """A local HTTP server (real sockets) with one PNG, a random 64 x 72 image, at /cat.png,
    /to-localhost.png redirecting to it under the host name localhost, and /slow.png answering it
    after a second; anything else is a 404."""
    import http.server
    import io
    import threading
    import time

    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 72, 3), dtype=np.uint8)).save(png, format="PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/to-localhost.png":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/cat.png")
                self.end_headers()
                return
            if self.path == "/slow.png":
                time.sleep(1.0)
            found = self.path in ("/cat.png", "/slow.png")
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if found:
                try:
                    self.wfile.write(png.getvalue())
                except (BrokenPipeError, ConnectionResetError):  # (a client that gave up waiting)
                    pass

        def log_message(self, *args: object) -> None:
            pass

    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{host.server_address[1]}"
    finally:
        host.shutdown()
        host.server_close()
        thread.join()


@pytest.fixture(scope="session")
def tiny_llava_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LLaVA 1.5 whose vision side is run (tests/test_image_inputs.py): a two-layer CLIP encoder of
    56 x 56 images (16 features each) and the projector drawn as widely as the decoder, so that
    an image changes the reply; its image processor saved beside it."""
    from transformers import CLIPImageProcessor

    model = build_tiny_multimodal_model(tmp_path_factory.mktemp("tiny_llava_images"),
                                        "LlavaForConditionalGeneration", "llama", tie_word_embeddings=False,
                                        vision_extra={"num_hidden_layers": 2, "image_size": 56})
    CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}).save_pretrained(model)
    return model


@pytest.fixture(scope="session")
def tiny_gemma3_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 whose vision side is run (tests/test_gemma3_images.py): a two-layer SigLIP encoder
    of 56 x 56 images (4 x 4 patches) pooled to 4 features per image, beside a two-layer Gemma 3
    decoder (a 3-token sliding window, then a global layer); start / end of image are the tiny
    vocabulary's tokens 997 / 998, the placeholder 999; its image processor saved beside it."""
    from transformers import Gemma3ImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(1)  # (transformers' own init draws the patch and position embeddings)
        model = build_tiny_multimodal_model(
            tmp_path_factory.mktemp("tiny_gemma3_images"), "Gemma3ForConditionalGeneration", "gemma3",
            tie_word_embeddings=False, head_dim=32,
            text_extra={"sliding_window": 3, "query_pre_attn_scalar": 32,
                        "layer_types": ["sliding_attention", "full_attention"]},
            vision_extra={"num_hidden_layers": 2, "image_size": 56, "vision_use_head": False},
            config_extra={"mm_tokens_per_image": 4, "boi_token_index": 997, "eoi_token_index": 998})
    Gemma3ImageProcessor(size={"height": 56, "width": 56}).save_pretrained(model)
    return model


def _paligemma_images(tmp_path_factory: pytest.TempPathFactory, text_arch: str, seed: int, tied: bool = True,
                      text_extra: dict | None = None) -> Path:
    """PaliGemma whose vision side is run (tests/test_paligemma_images.py): a two-layer SigLIP
    encoder of 56 x 56 images (4 x 4 patches: 16 features each) projected into a `text_arch`
    decoder; the tokenizer gains PaliGemma's `<image>` token (id 1000, special, as its releases
    have it: the vocabulary is 1,008)."""
    from transformers import SiglipImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build_tiny_multimodal_model(
            tmp_path_factory.mktemp(f"tiny_paligemma_{text_arch}"), "PaliGemmaForConditionalGeneration", text_arch,
            tie_word_embeddings=tied, head_dim=32, seed=seed, text_extra={"vocab_size": 1008, **(text_extra or {})},
            vision_extra={"num_hidden_layers": 2, "image_size": 56, "vision_use_head": False},
            config_extra={"projection_dim": 64, "hidden_size": 64, "vocab_size": 1008})
    _add_image_tokens(model, ["<image>"], {"image_token_index": "<image>"})
    SiglipImageProcessor(size={"height": 56, "width": 56}).save_pretrained(model)
    return model


@pytest.fixture(scope="session")
def tiny_paligemma_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PaliGemma (1): a Gemma decoder."""
    return _paligemma_images(tmp_path_factory, "gemma", seed=1)


@pytest.fixture(scope="session")
def tiny_paligemma2_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """PaliGemma 2: a Gemma 2 decoder (a 16-token sliding window, then a global layer; its
    attention and final logits soft-capped; an LM head of its own: tied, the tiny random decoder
    repeats its last input token whatever the image). The window is as wide as an image, as in
    every release (224 px: 256 tokens, 896 px: 4,096, window 4,096): transformers' PaliGemma lets
    an image's tokens see all of it past a narrower window (its Gemma 3 does not), this engine's
    window bounds them as the text's."""
    return _paligemma_images(tmp_path_factory, "gemma2", seed=3, tied=False, text_extra={"sliding_window": 16})


# SmolVLM's image prompt tokens, added to the tiny tokenizer as its releases have them
SMOLVLM_TOKENS = ["<fake_token_around_image>", "<global-img>", "<image>",
                  *[f"<row_{row}_col_{column}>" for row in (1, 2) for column in (1, 2)]]


@pytest.fixture(scope="session")
def tiny_smolvlm_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolVLM whose vision side is run (tests/test_smolvlm_images.py): a two-layer encoder of
    56 x 56 tiles (4 x 4 patches, pixel-shuffled by 2: 4 features a tile), a Llama decoder; its
    processor cuts an image into up to 2 x 2 tiles beside the whole image; the tokenizer gains
    SmolVLM's image tokens (ids 1000-1006, `<image>` 1002) and a "\\n\\n" token (1007)."""
    import json

    from transformers import SmolVLMImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_multimodal_model(
            tmp_path_factory.mktemp("tiny_smolvlm_images"), "SmolVLMForConditionalGeneration", "llama",
            tie_word_embeddings=False, text_extra={"vocab_size": 1008},
            vision_extra={"num_hidden_layers": 2, "image_size": 56}, config_extra={"scale_factor": 2})
    # (and "\n\n" one token, as SmolVLM's own tokenizer reads its image string's)
    _add_image_tokens(model, SMOLVLM_TOKENS, {"image_token_id": "<image>"}, plain=("\n\n",))
    SmolVLMImageProcessor(size={"longest_edge": 112}, max_image_size={"longest_edge": 56}).save_pretrained(model)
    return model


def _add_image_tokens(model: Path, tokens: list[str], config_ids: dict[str, str], plain: tuple[str, ...] = ()) -> None:
    """The tiny tokenizer gains a model's image tokens (special, as its releases have them; ids
    from 1000) and `plain` ones; the config's `config_ids` fields name their ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_special_tokens({"additional_special_tokens": tokens}, replace_extra_special_tokens=False)
    tokenizer.add_tokens(list(plain))
    tokenizer.save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    config.update({field: tokenizer.convert_tokens_to_ids(token) for field, token in config_ids.items()})
    (model / "config.json").write_text(json.dumps(config))


# Qwen2-VL's image tokens, added to the tiny tokenizer (ids 1000-1002) as its releases have them
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


@pytest.fixture(scope="session")
def tiny_qwen2_vl_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-VL whose vision side is run (tests/test_qwen2_vl_images.py): a two-block vision
    transformer of 14-pixel patches (2 x 2 merged into one feature), a Qwen2 decoder with M-RoPE
    sections (2, 3, 3); its processor resizes an image to 4 to 16 merged squares of 28 pixels."""
    return _qwen_vl_images(tmp_path_factory, "Qwen2VLForConditionalGeneration", {"depth": 2})


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2.5-VL whose vision side is run, as `tiny_qwen2_vl_images`; its first block attends
    within windows of 2 x 2 merged squares (56 pixels), its second over the whole image."""
    return _qwen_vl_images(tmp_path_factory, "Qwen2_5_VLForConditionalGeneration",
                           {"depth": 2, "window_size": 56, "fullatt_block_indexes": [1]})


@pytest.fixture(scope="session")
def tiny_qwen3_vl_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL whose vision side is run: a three-block vision transformer of 16-pixel patches
    (2 x 2 merged into one feature) with a learned 4 x 4 position grid, DeepStack from its first
    and last blocks (added after the two decoder layers), a Qwen3 decoder with interleaved M-RoPE
    sections (2, 3, 3); its processor resizes an image to 4 to 16 merged squares of 32 pixels."""
    return _qwen_vl_images(tmp_path_factory, "Qwen3VLForConditionalGeneration",
                           {"depth": 3, "patch_size": 16, "num_position_embeddings": 16,
                            "deepstack_visual_indexes": [0, 2]}, text_arch="qwen3", patch_size=16)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-VL-MoE whose vision side is run: `tiny_qwen3_vl_images`' vision side beside
    `tiny_qwen3_vl_moe`'s decoder (stacked experts)."""
    return _qwen_vl_images(tmp_path_factory, "Qwen3VLMoeForConditionalGeneration",
                           {"depth": 3, "patch_size": 16, "num_position_embeddings": 16,
                            "deepstack_visual_indexes": [0, 2]}, text_arch="qwen3_moe", patch_size=16,
                           text_extra=QWEN3_VL_MOE_TEXT)


def _qwen_vl_images(factory: pytest.TempPathFactory, architecture: str, vision_extra: dict,
                    text_arch: str = "qwen2", patch_size: int = 14, text_extra: dict | None = None) -> Path:
    from transformers import Qwen2VLImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_multimodal_model(
            factory.mktemp(f"tiny_{architecture}_images"), architecture, text_arch,
            tie_word_embeddings=False, text_extra={"vocab_size": 1003, **(text_extra or {})},
            vision_extra=vision_extra)
    _add_image_tokens(model, QWEN2_VL_TOKENS, dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id"),
                                                       QWEN2_VL_TOKENS)))
    square = 2 * patch_size  # (a merged square's pixels)
    Qwen2VLImageProcessor(patch_size=patch_size, min_pixels=square * square * 4,
                          max_pixels=square * square * 16).save_pretrained(model)
    return model


@pytest.fixture(scope="session")
def tiny_llava_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LlavaNextForConditionalGeneration (LLaVA-NeXT / 1.6): CLIP encoder, its image_newline, Qwen2 decoder."""
    return _build_multimodal(tmp_path_factory, "tiny_llava_next", "LlavaNextForConditionalGeneration", "qwen2",
                             tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_llava_onevision(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """LlavaOnevisionForConditionalGeneration (LLaVA-OneVision): SigLIP encoder, Qwen2 decoder."""
    return _build_multimodal(tmp_path_factory, "tiny_llava_onevision", "LlavaOnevisionForConditionalGeneration",
                             "qwen2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_internvl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """InternVLForConditionalGeneration (InternVL3's transformers format): InternViT encoder, Qwen2 decoder, tied."""
    return _build_multimodal(tmp_path_factory, "tiny_internvl", "InternVLForConditionalGeneration", "qwen2",
                             tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2VLForConditionalGeneration: M-RoPE sections, Qwen2 decoder, untied."""
    return _build_multimodal(tmp_path_factory, "tiny_qwen2_vl", "Qwen2VLForConditionalGeneration", "qwen2",
                             tie_word_embeddings=False)


# Mistral 3's image tokens, added to the tiny tokenizer (ids 1000-1002) as its releases have them
MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


@pytest.fixture(scope="session")
def tiny_mistral3_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral 3 whose vision side is run (tests/test_mistral3_images.py): a two-layer Pixtral of
    14-pixel patches (2 x 2 merged into one feature) reading images of up to 112 pixels a side
    whole, a Mistral decoder; its processor resizes an image to whole 28-pixel squares."""
    from transformers import PixtralImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_multimodal_model(
            tmp_path_factory.mktemp("tiny_mistral3_images"), "Mistral3ForConditionalGeneration", "mistral",
            tie_word_embeddings=False, text_extra={"vocab_size": 1003},
            vision_extra={"num_hidden_layers": 2, "image_size": 112}, config_extra={"multimodal_projector_bias": True})
    _add_image_tokens(model, MISTRAL3_TOKENS, {"image_token_index": "[IMG]"})
    # (as Mistral Small 3.1's: the encoder's patch size; its processor asks for merged squares)
    PixtralImageProcessor(size={"longest_edge": 112}, patch_size={"height": 14, "width": 14}).save_pretrained(model)
    return model


@pytest.fixture(scope="session")
def tiny_pixtral_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Pixtral-12B's form (LlavaForConditionalGeneration with a Pixtral encoder): `tiny_mistral3_images`'
    encoder reading images of up to 56 pixels a side, every 14-pixel patch a feature, LLaVA's
    projector; the same image tokens."""
    from transformers import PixtralImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_multimodal_model(
            tmp_path_factory.mktemp("tiny_pixtral_images"), "LlavaForConditionalGeneration", "mistral",
            tie_word_embeddings=False, text_extra={"vocab_size": 1003},
            vision_extra={"model_type": "pixtral", "num_hidden_layers": 2, "image_size": 56, "head_dim": 16},
            config_extra={"vision_feature_select_strategy": "full"})
    _add_image_tokens(model, MISTRAL3_TOKENS, {"image_token_index": "[IMG]"})
    PixtralImageProcessor(size={"longest_edge": 56}, patch_size={"height": 14, "width": 14}).save_pretrained(model)
    return model


# InternVL's image tokens, added to the tiny tokenizer (ids 1000-1002) as its releases have them
INTERNVL_TOKENS = ["<img>", "</img>", "<IMG_CONTEXT>"]


@pytest.fixture(scope="session")
def tiny_internvl_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """InternVL whose vision side is run (tests/test_internvl_images.py): a two-layer InternViT of
    56 x 56 tiles (4 x 4 patches, shuffled by 2: 4 features a tile) with layer norms and q/k/v
    biases (InternVL3's 300M encoder's form), a Qwen2 decoder; its processor cuts an image into up
    to 4 tiles beside a thumbnail."""
    return _internvl_images(tmp_path_factory, {})


@pytest.fixture(scope="session")
def tiny_internvl_rms_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As `tiny_internvl_images` with InternViT-6B's form: RMS norms, q and k RMS-normed, no
    q/k/v biases."""
    return _internvl_images(tmp_path_factory, {"norm_type": "rms_norm", "use_qk_norm": True, "attention_bias": False})


def _internvl_images(factory: pytest.TempPathFactory, vision_extra: dict) -> Path:
    from transformers import GotOcr2ImageProcessor

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_tiny_multimodal_model(
            factory.mktemp("tiny_internvl_images"), "InternVLForConditionalGeneration", "qwen2",
            tie_word_embeddings=False, text_extra={"vocab_size": 1003},
            vision_extra={"num_hidden_layers": 2, "image_size": [56, 56], "attention_bias": True, **vision_extra},
            config_extra={"image_seq_length": 4})
    _add_image_tokens(model, INTERNVL_TOKENS, {"image_token_id": "<IMG_CONTEXT>"})
    # (as InternVL3-hf's: tiles cut by its processor's default, not this file's)
    GotOcr2ImageProcessor(size={"height": 56, "width": 56}, crop_to_patches=False, max_patches=4).save_pretrained(model)
    return model


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Idefics3ForConditionalGeneration: SigLIP encoder, Llama decoder under `model.text_model`."""
    return _build_multimodal(tmp_path_factory, "tiny_idefics3", "Idefics3ForConditionalGeneration", "llama",
                             tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2_5_VLForConditionalGeneration: M-RoPE sections, Qwen2 decoder (q/k/v biases), tied."""
    return _build_multimodal(tmp_path_factory, "tiny_qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", "qwen2",
                             tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3VLForConditionalGeneration: interleaved M-RoPE, Qwen3 decoder (qk-norm), DeepStack encoder."""
    return _build_multimodal(tmp_path_factory, "tiny_qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3",
                             tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3VLMoeForConditionalGeneration: Qwen3-VL with a Qwen3-MoE decoder (4 experts of width
    24, top 2, always renormalized; layer 0 dense) whose experts are stacked tensors."""
    return _build_multimodal(tmp_path_factory, "tiny_qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "qwen3_moe",
                             tie_word_embeddings=False, text_extra=QWEN3_VL_MOE_TEXT)


# the tiny Qwen3-VL-MoE decoder's experts (2 x 24 != the hidden 64: the stacked tensors' two
# layouts differ in shape)
QWEN3_VL_MOE_TEXT = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "mlp_only_layers": [0],
                     "norm_topk_prob": True}


@pytest.fixture(scope="session")
def tiny_smolvlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolVLMForConditionalGeneration (SmolVLM / SmolVLM2): SigLIP encoder, Llama decoder (`model.text_model`)."""
    return _build_multimodal(tmp_path_factory, "tiny_smolvlm", "SmolVLMForConditionalGeneration", "llama",
                             tie_word_embeddings=False)


PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                 "long_factor": [1.0, 1.5, 2.2, 3.0, 4.0, 5.5, 7.0, 9.0],
                 "original_max_position_embeddings": 256}


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-3 with fused qkv_proj / gate_up_proj tensors and LongRoPE (short factors up to the
    original 256 positions, attention factor from max_position_embeddings 512 / 256)."""
    return _build(tmp_path_factory, "tiny_phi3", "phi3", tie_word_embeddings=False,
                  extra_config={"rope_parameters": PHI3_LONGROPE, "original_max_position_embeddings": 256})


@pytest.fixture(scope="session")
def tiny_phi4_mini(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-4-mini's form of Phi-3: rotary over 3/4 of each head (LongRoPE factors for those 12 of
    16 dimensions), GQA, tied embeddings."""
    rotary_pairs = 6  # (head_dim 16 x 0.75 / 2)
    longrope = {**PHI3_LONGROPE, "short_factor": PHI3_LONGROPE["short_factor"][:rotary_pairs],
                "long_factor": PHI3_LONGROPE["long_factor"][:rotary_pairs], "partial_rotary_factor": 0.75}
    return _build(tmp_path_factory, "tiny_phi4_mini", "phi3", tie_word_embeddings=True,
                  extra_config={"rope_parameters": longrope, "original_max_position_embeddings": 256,
                                "partial_rotary_factor": 0.75})


@pytest.fixture(scope="session")
def tiny_deepseek_v2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V2 (the Transformers fallback): latent attention, keys of 8 + 8 dimensions and
    values of 24 per head, a dense first layer, then 4 routed experts and a shared one."""
    return _build(tmp_path_factory, "tiny_deepseek_v2", "deepseek_v2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3 / Moonlight / Kimi's architecture (the Transformers fallback): latent attention
    with a LoRA-compressed query, sigmoid-scored experts."""
    return _build(tmp_path_factory, "tiny_deepseek_v3", "deepseek_v3", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 4's text model (transformers >= 5.25; the Transformers fallback): sliding layers of
    head_dim 16 and 2 KV heads, global layers of 32 and 1 (the cache holds every layer at 32 x 2),
    keys as values on the global layers, per-layer inputs, the last 2 layers on shared KV."""
    import transformers

    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("Gemma 4 is transformers >= 5.25's")
    return _build(tmp_path_factory, "tiny_gemma4", "gemma4", tie_word_embeddings=True, num_layers=4)


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5's text model (transformers >= 5.25; the Transformers fallback): 3 Gated DeltaNet
    layers (a per-request convolution and delta-rule state) then 1 of gated attention."""
    import transformers

    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip("Qwen3.5 is transformers >= 5.25's")
    return _build(tmp_path_factory, "tiny_qwen3_5", "qwen3_5_text", tie_word_embeddings=True, num_layers=4)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5-MoE's text model (transformers >= 5.25; the Transformers fallback): tiny_qwen3_5's
    layers with 4 experts (2 a token) and a gated shared expert."""
    import transformers

    if not hasattr(transformers, "Qwen3_5MoeTextConfig"):
        pytest.skip("Qwen3.5-MoE is transformers >= 5.25's")
    return _build(tmp_path_factory, "tiny_qwen3_5_moe", "qwen3_5_moe_text", tie_word_embeddings=False, num_layers=4)


@pytest.fixture(scope="session")
def tiny_gemma3n(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3n's text model (the Transformers fallback): AltUp, LAuReL, per-layer inputs, local /
    global layers, the last 2 of 4 layers reading the keys and values of earlier ones."""
    return _build(tmp_path_factory, "tiny_gemma3n", "gemma3n", tie_word_embeddings=True, num_layers=4)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss (the Transformers fallback): attention sinks, a sliding-window layer (8) then a full
    one, 4 experts (2 a token) with clamped SwiGLU and biases."""
    return _build(tmp_path_factory, "tiny_gpt_oss", "gpt_oss", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_opt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OPT: learned positions, ReLU, biases, pre-LayerNorm, word embeddings of 32 projected in
    and out of the hidden size 64 (project_in / project_out), tied LM head."""
    return _build(tmp_path_factory, "tiny_opt", "opt", tie_word_embeddings=True,
                  extra_config={"word_embed_proj_dim": 32})


@pytest.fixture(scope="session")
def tiny_opt_post_norm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OPT-350m style: LayerNorm after attention and MLP (do_layer_norm_before=False), untied."""
    return _build(tmp_path_factory, "tiny_opt_post_norm", "opt", tie_word_embeddings=False,
                  extra_config={"do_layer_norm_before": False})


@pytest.fixture(scope="session")
def tiny_gpt_neox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-NeoX as Pythia's config.json has it (`rotary_pct`, `rotary_emb_base`, no rope dict):
    partial rotary (25% of each head), parallel residual, LayerNorm with biases, exact gelu."""
    out = _build(tmp_path_factory, "tiny_gpt_neox", "gpt_neox", tie_word_embeddings=False,
                 extra_config={"rotary_pct": 0.25})
    config = json.loads((out / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps({**config, "rotary_pct": 0.25, "rotary_emb_base": 10000}))
    return out


@pytest.fixture(scope="session")
def tiny_gpt_neox_serial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-NeoX as transformers 5 writes it (rope_parameters' partial_rotary_factor, here half of
    each head), with the sequential residual and the tanh gelu."""
    return _build(tmp_path_factory, "tiny_gpt_neox_serial", "gpt_neox", tie_word_embeddings=False,
                  extra_config={"rotary_pct": 0.5, "use_parallel_residual": False, "hidden_act": "gelu_new"})


@pytest.fixture(scope="session")
def tiny_phi2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-2: partial rotary (half of each head), attention and MLP side by side on one
    LayerNorm's output, biases everywhere including the LM head."""
    return _build(tmp_path_factory, "tiny_phi2", "phi", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_stablelm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """StableLM 2 (1.6B's form): LayerNorm, partial rotary (a quarter of each head), q/k/v biases,
    GQA, the sequential residual."""
    return _build(tmp_path_factory, "tiny_stablelm", "stablelm", tie_word_embeddings=False, attention_bias=True,
                  extra_config={"partial_rotary_factor": 0.25})


@pytest.fixture(scope="session")
def tiny_stablelm_parallel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """StableLM with the parallel residual (one LayerNorm per layer) and no q/k/v biases."""
    return _build(tmp_path_factory, "tiny_stablelm_parallel", "stablelm", tie_word_embeddings=False,
                  extra_config={"partial_rotary_factor": 0.5, "use_parallel_residual": True})


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2 as openai-community/gpt2 ships it: a GPT2Model's tensor names (no `transformer.`
    prefix, no lm_head: tied to wte), the causal-mask buffers beside the weights, Conv1D
    projections ([in, out])."""
    from safetensors.torch import load_file, save_file

    out = _build(tmp_path_factory, "tiny_gpt2", "gpt2", tie_word_embeddings=True)
    tensors = {name.removeprefix("transformer."): t for name, t in load_file(out / "model.safetensors").items()
               if not name.startswith("lm_head.")}
    mask = torch.tril(torch.ones(512, 512)).view(1, 1, 512, 512)
    for layer in range(2):
        tensors[f"h.{layer}.attn.bias"] = mask.clone()
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def tiny_gpt_bigcode(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPTBigCode (SantaCoder / StarCoder 1): multi-query attention, gelu-tanh, tied head; its
    config.json as the hub's were written (no num_key_value_heads beside multi_query)."""
    out = _build(tmp_path_factory, "tiny_gpt_bigcode", "gpt_bigcode", tie_word_embeddings=True)
    config = json.loads((out / "config.json").read_text())
    config.pop("num_key_value_heads")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_gpt_bigcode_mha(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPTBigCode with multi_query false: c_attn fused per head, untied head, exact gelu."""
    return _build(tmp_path_factory, "tiny_gpt_bigcode_mha", "gpt_bigcode", tie_word_embeddings=False,
                  extra_config={"multi_query": False, "activation_function": "gelu"})


@pytest.fixture(scope="session")
def tiny_gptj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-J: rotary over half of each head with neighbouring pairs turned, attention and MLP side
    by side, an LM head with a bias."""
    return _build(tmp_path_factory, "tiny_gptj", "gptj", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_codegen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CodeGen (the Transformers fallback): GPT-2's config names (n_embd, n_head, ...), read
    through transformers' attribute_map."""
    return _build(tmp_path_factory, "tiny_codegen", "codegen", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-MoE: routed experts (4, top 2) and a shared expert gated per token by a sigmoid,
    q/k/v biases; the first layer dense (mlp_only_layers)."""
    return _build(tmp_path_factory, "tiny_qwen2_moe", "qwen2_moe", tie_word_embeddings=False,
                  extra_config={"mlp_only_layers": [0]})


@pytest.fixture(scope="session")
def tiny_olmoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OLMoE (the Transformers fallback): a mixture of experts whose forward reads the base
    model's router logits."""
    return _build(tmp_path_factory, "tiny_olmoe", "olmoe", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_bloom(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bloom: ALiBi (no position embeddings), a LayerNorm after the embeddings, per-head fused
    query_key_value; 6 heads, so the slopes include the series past the largest power of two."""
    return _build(tmp_path_factory, "tiny_bloom", "bloom", tie_word_embeddings=True, num_heads=6, hidden_size=96)


@pytest.fixture(scope="session")
def tiny_falcon(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Falcon-7B's form: multi-query attention (one KV head), attention and MLP side by side on
    one LayerNorm, no biases, tied head."""
    return _build(tmp_path_factory, "tiny_falcon", "falcon", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_falcon_40b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Falcon-40B's form: the new decoder architecture (2 KV groups of 2 queries, query_key_value
    grouped per KV head), two LayerNorms per layer; with biases and an untied head."""
    return _build(tmp_path_factory, "tiny_falcon_40b", "falcon", tie_word_embeddings=False,
                  extra_config={"new_decoder_architecture": True, "num_kv_heads": 2, "bias": True})


@pytest.fixture(scope="session")
def tiny_falcon_sequential(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Falcon with multi-head attention (query_key_value per head) and the sequential residual."""
    return _build(tmp_path_factory, "tiny_falcon_sequential", "falcon", tie_word_embeddings=True,
                  extra_config={"multi_query": False, "parallel_attn": False})


@pytest.fixture(scope="session")
def tiny_mpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MPT: ALiBi with MPT's slope series (6 heads: the odd terms of 8's, then the even), bias-free
    LayerNorm and projections, fused Wqkv, tied head."""
    return _build(tmp_path_factory, "tiny_mpt", "mpt", tie_word_embeddings=True, num_heads=6, hidden_size=96)


@pytest.fixture(scope="session")
def tiny_olmo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OLMo (1): weightless float32 LayerNorms, q/k/v clamped (OLMo 1.7's clip_qkv), biases."""
    return _build(tmp_path_factory, "tiny_olmo", "olmo", tie_word_embeddings=False, attention_bias=True,
                  extra_config={"clip_qkv": 0.5})


@pytest.fixture(scope="session")
def tiny_cohere(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Cohere Command-R (no native implementation: the Transformers fallback): interleaved
    rotary, attention and MLP side by side, a logit scale."""
    return _build(tmp_path_factory, "tiny_cohere", "cohere", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Granite: Llama with embedding, residual, attention and logits multipliers, all away from 1
    and none a power of two but the residual's (the attention one is the softmax scale)."""
    return _build(tmp_path_factory, "tiny_granite", "granite", tie_word_embeddings=False,
                  extra_config={"embedding_multiplier": 2.5, "residual_multiplier": 0.5,
                                "attention_multiplier": 0.1, "logits_scaling": 3.0})


@pytest.fixture(scope="session")
def tiny_smollm3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM3: Llama with rotary left out of layer 1 (`no_rope_layers` [1, 0]), tied embeddings."""
    return _build(tmp_path_factory, "tiny_smollm3", "smollm3", tie_word_embeddings=True,
                  extra_config={"no_rope_layers": [1, 0]})


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma (1): (1 + w) RMSNorm, scaled embeddings, gelu-tanh MLP, GQA 4 / 2, tied."""
    return _build(tmp_path_factory, "tiny_gemma", "gemma", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_olmo2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OLMo 2: post-norm blocks, q and k normalized over their whole projection, GQA 4 / 2, untied."""
    return _build(tmp_path_factory, "tiny_olmo2", "olmo2", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_starcoder2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """StarCoder2: LayerNorm blocks, a plain gelu-tanh MLP, biases everywhere, untied (its sliding
    window: tests/model/test_families.py)."""
    return _build(tmp_path_factory, "tiny_starcoder2", "starcoder2", tie_word_embeddings=False,
                  extra_config={"norm_epsilon": 1e-5})


@pytest.fixture(scope="session")
def tiny_qwen2_window(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 with use_sliding_window: layer 0 global, layer 1 local with window 8
    (max_window_layers=1); mixed layers, so no KV block is freed."""
    return _build(tmp_path_factory, "tiny_qwen2_window", "qwen2", tie_word_embeddings=False,
                  extra_config={"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1})
