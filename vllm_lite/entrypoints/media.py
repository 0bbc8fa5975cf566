"""Images named in chat messages (vLLM's `image_url` parts): data URLs decoded, http(s) URLs
fetched (vLLM's VLLM_IMAGE_FETCH_TIMEOUT: 5 s; the server fetches them concurrently on its event
loop, LLM.chat in the caller's thread), each opened with Pillow. Anything else is refused naming
the URL's scheme; a fetched image larger than MAX_IMAGE_BYTES is refused naming the limit."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

IMAGE_FETCH_TIMEOUT_S = 5.0
MAX_IMAGE_BYTES = 64 << 20  # (a fetched body is read up to this, never whole into memory unbounded)


def load_image(url: Any) -> Any:
    """The PIL image an `image_url` names (ValueError naming what is wrong with it)."""
    data = inline_image_bytes(url)
    return open_image(data if data is not None else _fetched(url))


async def load_image_bytes(url: Any, client: Any) -> bytes:
    """The bytes of the image an `image_url` names, fetched with `client` (an httpx.AsyncClient)
    where it is an http(s) URL."""
    data = inline_image_bytes(url)
    if data is not None:
        return data
    import httpx

    try:
        async with client.stream("GET", url, follow_redirects=True) as response:
            response.raise_for_status()
            return await _bounded(response.aiter_bytes(), url)
    except httpx.HTTPError as exc:
        raise ValueError(f"image_url: fetching {url} failed: {exc}") from None


def inline_image_bytes(url: Any) -> bytes | None:
    """A data URL's bytes; None for an http(s) URL (to be fetched); ValueError for anything else."""
    if not isinstance(url, str):
        raise ValueError(f"image_url.url must be a string, got {type(url).__name__}")
    if url.startswith(("http://", "https://")):
        return None
    if not url.startswith("data:"):
        scheme = url.partition(":")[0] if ":" in url else url[:20]
        raise ValueError(f"image_url: URLs of scheme {scheme!r} are not implemented (data: and http(s): URLs are; "
                         "vLLM's file: URLs with --allowed-local-media-path are not)")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError("image_url: a data URL must be base64-encoded (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"image_url: the data URL is not valid base64: {exc}") from None


def open_image(data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image could not be decoded: {exc}") from None
    return image


def _fetched(url: str) -> bytes:
    import httpx

    try:
        with httpx.stream("GET", url, timeout=IMAGE_FETCH_TIMEOUT_S, follow_redirects=True) as response:
            response.raise_for_status()
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                _check_size(len(body), url)
            return bytes(body)
    except httpx.HTTPError as exc:
        raise ValueError(f"image_url: fetching {url} failed: {exc}") from None


async def _bounded(chunks: Any, url: str) -> bytes:
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        _check_size(len(body), url)
    return bytes(body)


def _check_size(size: int, url: str) -> None:
    if size > MAX_IMAGE_BYTES:
        raise ValueError(f"image_url: {url} is larger than {MAX_IMAGE_BYTES >> 20} MiB (the most an image may be)")
