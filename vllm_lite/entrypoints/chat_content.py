"""Message content as the chat template reads it (vLLM's chat_template_content_format).

"string": each message's text parts joined with newlines. "openai": a list of parts,
`[{"type": "text", "text": ...}]` (a string content becomes one part), for templates that loop
over a message's content; tool messages stay strings, as vLLM keeps them. "auto" picks by
reading the template: a loop over a message's `content` means "openai". Text parts, and image
parts (vLLM's `image_url` and `image_pil`) where the model takes images: the template sees an
image as `{"type": "image"}` ("openai") or as the model's image placeholder on a line of its own
before the text ("string"), as vLLM shows them; any other part is refused by name.

A text part's other fields (TranslateGemma's template reads `source_lang_code` and
`target_lang_code` there) reach the template as the part's, as in vLLM, with the "openai"
format; where the content becomes a string they could reach nothing, so they are refused by
name."""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2 import nodes

from vllm_lite.config import MediaAccess

CONTENT_FORMATS = ("auto", "string", "openai")


TEXT_PART_FIELDS = frozenset({"type", "text"})
# ("uuid": vLLM's id of the image for its caches; with it the image may be left out, None, once sent)
IMAGE_PART_FIELDS = {"image_url": frozenset({"type", "image_url", "uuid"}),
                     "image_pil": frozenset({"type", "image_pil", "uuid"})}
IMAGE_PART_TYPES = tuple(IMAGE_PART_FIELDS)
# OpenAI's resolution hint: the model's image processor fixes the resolution, so each is the same
# here (as in vLLM)
IMAGE_DETAILS = ("auto", "low", "high")


def content_parts(content: Any, images_refused: str | None = None) -> list[dict[str, Any]]:
    """A message's content as its parts (a string is one text part, None none), each checked;
    image parts are taken unless `images_refused` says why not."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"a message's content must be a string or a list of parts, got {type(content).__name__}")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "prompt_embeds":
            raise ValueError("prompt_embeds content parts (vLLM's chat prompts mixing text and embeddings) are not "
                             "implemented: give the whole prompt's embeddings to /v1/completions' prompt_embeds")
        if kind in IMAGE_PART_TYPES and images_refused is None:
            _check_image_part(part)
            continue
        if kind != "text":
            media = (f"image inputs are not taken here: {images_refused}" if kind in IMAGE_PART_TYPES else
                     "audio and video inputs are not implemented")
            raise ValueError(f"only text content parts are supported, got a part of type {kind!r} ({media})")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"a text content part's `text` must be a string, got {part.get('text')!r}")
    return content


def _check_image_part(part: dict[str, Any]) -> None:
    kind = part["type"]
    unknown = sorted(set(part) - IMAGE_PART_FIELDS[kind])
    if unknown:
        raise ValueError(f"an {kind} content part's field(s) {unknown} are not implemented")
    uuid = part.get("uuid")
    if uuid is not None and not (isinstance(uuid, str) and uuid):
        raise ValueError(f"an {kind} content part's uuid must be a non-empty string, got {uuid!r:.100}")
    if part.get(kind) is None and uuid is None:
        raise ValueError(f"an {kind} content part without its {kind} needs the uuid of an image sent before")
    url = part.get("image_url")
    if kind == "image_url" and isinstance(url, dict):
        unknown = sorted(set(url) - {"url", "detail"})
        if unknown:
            raise ValueError(f"image_url field(s) {unknown} are not implemented (url, detail are)")
        if url.get("detail") not in (None, *IMAGE_DETAILS):
            raise ValueError(f"image_url.detail must be one of {IMAGE_DETAILS}, got {url.get('detail')!r}")


def content_texts(content: Any) -> list[str]:
    """The text of each text part of a message's content (a string is one part, None none);
    image parts pass here (whether the model takes them is `with_content_format`'s to say)."""
    return [part["text"] for part in content_parts(content) if part["type"] == "text"]


def with_content_format(conversation: list[dict[str, Any]], content_format: str,
                        image_placeholder: str | None = None,
                        images_refused: str = "the model takes no images") -> list[dict[str, Any]]:
    """The messages with their content in `content_format` ("string" or "openai");
    `image_placeholder`: the model takes images, which the "string" format writes so; without
    it an image part is refused, naming `images_refused`."""
    return [{**message, "content": _formatted(message.get("content"), message.get("role"), content_format,
                                              image_placeholder, images_refused)}
            for message in conversation]


def developer_as_system(conversation: list[dict[str, Any]], template: Any) -> list[dict[str, Any]]:
    """vLLM's rule for a template that does not name OpenAI's `developer` role: such messages
    become `system` ones (without `tools`), and the system messages then merge, their texts
    joined by a blank line, into one first message (templates such as Qwen's want a single one
    there). Other conversations are returned as they are."""
    text = template if isinstance(template, str) else str(template)
    if not any(m.get("role") == "developer" for m in conversation) or "'developer'" in text or '"developer"' in text:
        return conversation
    converted = [{key: value for key, value in m.items() if key != "tools"} | {"role": "system"}
                 if m.get("role") == "developer" else m for m in conversation]
    systems = [i for i, m in enumerate(converted) if m.get("role") == "system"]
    if systems == [0]:
        return converted
    texts = ["\n".join(content_texts(converted[i].get("content"))) for i in systems]
    merged = {"role": "system", "content": "\n\n".join(text for text in texts if text)}
    return [merged, *(m for m in converted if m.get("role") != "system")]


def image_placeholder(tokenizer: Any, image_encoder: Any) -> str | None:
    """The text of the token a prompt carries per image (what the "string" format writes for an
    image: vision_config.ImageEncoderConfig.prompt_token_id, Gemma 3's start-of-image token;
    Qwen2-VL's between its vision start and end tokens, as vLLM writes it); None where the model
    takes no images."""
    if image_encoder is None or tokenizer is None:
        return None
    frame = image_encoder.frame_token_ids
    ids = [image_encoder.prompt_token_id] if frame is None else [frame[0], image_encoder.prompt_token_id, frame[1]]
    return "".join(tokenizer.convert_ids_to_tokens(ids))


def conversation_images(conversation: list[dict[str, Any]], access: MediaAccess) -> list[Any]:
    """The images of the messages' image parts, in order (URLs fetched or decoded: media.py)."""
    from vllm_lite.entrypoints.media import load_image

    return [load_image(source, access) if isinstance(source, str) else source for source in image_sources(conversation)]


def image_uuids(conversation: list[dict[str, Any]]) -> list[str | None]:
    """Each image part's vLLM `uuid` (None where it has none), in order."""
    return [part.get("uuid") for message in conversation for part in content_parts(message.get("content"))
            if part["type"] in IMAGE_PART_TYPES]


def image_sources(conversation: list[dict[str, Any]]) -> list[Any]:
    """Each image part's URL (`image_url`) or PIL image (`image_pil`), in order (None: left out,
    its uuid naming it)."""
    sources = []
    for message in conversation:
        for part in content_parts(message.get("content")):
            if part["type"] == "image_url":
                url = part.get("image_url")
                sources.append(url.get("url") if isinstance(url, dict) else url)
            elif part["type"] == "image_pil":
                sources.append(part.get("image_pil"))
    return sources


def _formatted(content: Any, role: Any, content_format: str, image_placeholder: str | None,
               images_refused: str) -> str | list[dict[str, Any]]:
    parts = content_parts(content, None if image_placeholder is not None else images_refused)
    if image_placeholder is not None:
        if content_format == "openai" and role != "tool":  # (each image where its part was)
            return [{"type": "image"} if part["type"] in IMAGE_PART_TYPES else dict(part) for part in parts]
        num_images = sum(part["type"] in IMAGE_PART_TYPES for part in parts)
        parts = ([{"type": "text", "text": image_placeholder}] * num_images
                 + [part for part in parts if part["type"] not in IMAGE_PART_TYPES])
    if content_format == "openai" and role != "tool":
        return [dict(part) for part in parts]
    extra = sorted({key for part in parts for key in part} - TEXT_PART_FIELDS)
    if extra:
        where = "a tool message's content" if role == "tool" else "content given to the template as a string"
        raise ValueError(f"content part field(s) {', '.join(extra)}: {where} keeps only the parts' text; other "
                         "fields reach the chat template with --chat-template-content-format openai (or a "
                         "template that loops over a message's content)")
    return "\n".join(part["text"] for part in parts)


def resolve_content_format(requested: str, template: Any) -> str:
    """`requested` unless it is "auto"; then what the template reads (`detect_content_format`)."""
    if requested not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, got {requested!r}")
    if requested != "auto":
        return requested
    if isinstance(template, dict):  # a tokenizer's named templates
        template = template.get("default")
    return detect_content_format(template) if isinstance(template, str) else "string"


def detect_content_format(template: str) -> str:
    """"openai" when the template loops over the content of a message it took from `messages`,
    else "string" (also for a template jinja cannot parse: rendering will say why)."""
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    loops = list(tree.find_all(nodes.For))
    message_names = {name for loop in loops if _is_name(loop.iter, {"messages"}) for name in _target_names(loop)}
    if any(_is_content_of(loop.iter, message_names) for loop in loops):
        return "openai"
    return "string"


def _target_names(loop: nodes.For) -> set[str]:
    targets = loop.target.items if isinstance(loop.target, nodes.Tuple) else [loop.target]
    return {target.name for target in targets if isinstance(target, nodes.Name)}


def _unwrapped(node: nodes.Node) -> nodes.Node:
    """Past filters, tests and slices: `messages[1:]`, `message.content | list`."""
    while True:
        if isinstance(node, nodes.Filter) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Test):
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def _is_name(node: nodes.Node, names: set[str]) -> bool:
    node = _unwrapped(node)
    return isinstance(node, nodes.Name) and node.name in names


def _is_content_of(node: nodes.Node, names: set[str]) -> bool:
    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content" and _is_name(node.node, names)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value == "content" and _is_name(node.node, names)
    return False
