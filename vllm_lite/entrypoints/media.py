"""Images named in chat messages (vLLM's `image_url` parts): data URLs decoded, http(s) URLs
fetched (vLLM's VLLM_IMAGE_FETCH_TIMEOUT: 5 s), each opened with Pillow. Anything else is refused
naming the URL's scheme."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

IMAGE_FETCH_TIMEOUT_S = 5.0


def load_image(url: Any) -> Any:
    """The PIL image an `image_url` names (ValueError naming what is wrong with it)."""
    if not isinstance(url, str):
        raise ValueError(f"image_url.url must be a string, got {type(url).__name__}")
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError("image_url: a data URL must be base64-encoded (data:image/...;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"image_url: the data URL is not valid base64: {exc}") from None
    elif url.startswith(("http://", "https://")):
        data = _fetched(url)
    else:
        scheme = url.partition(":")[0] if ":" in url else url[:20]
        raise ValueError(f"image_url: URLs of scheme {scheme!r} are not implemented (data: and http(s): URLs are; "
                         "vLLM's file: URLs with --allowed-local-media-path are not)")
    return open_image(data)


def open_image(data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"the image could not be decoded: {exc}") from None
    return image


def _fetched(url: str) -> bytes:
    import httpx

    try:
        response = httpx.get(url, timeout=IMAGE_FETCH_TIMEOUT_S, follow_redirects=True)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ValueError(f"image_url: fetching {url} failed: {exc}") from None
    return response.content
