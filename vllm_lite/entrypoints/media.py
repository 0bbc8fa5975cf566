"""Images named in chat messages (vLLM's `image_url` parts): data URLs decoded, http(s) URLs
fetched (within vLLM's VLLM_IMAGE_FETCH_TIMEOUT, 5 s by default, following redirects unless
VLLM_MEDIA_URL_ALLOW_REDIRECTS=0; the server fetches them concurrently on its event loop, LLM.chat
in the caller's thread), file: URLs read under vLLM's --allowed-local-media-path,
each opened with Pillow. Where URLs may point is the model config's `MediaAccess` (vLLM's
--allowed-media-domains: every host a fetch reaches, redirects included, must be listed, checked
by `fetch_client`'s hook).
Anything else is refused naming the URL's scheme; an image larger than MAX_IMAGE_BYTES is
refused naming the limit."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from vllm_lite.config import MediaAccess

MAX_IMAGE_BYTES = 64 << 20  # (a fetched body is read up to this, never whole into memory unbounded)


def load_image(url: Any, access: MediaAccess) -> Any:
    """The PIL image an `image_url` names (ValueError naming what is wrong with it)."""
    data = inline_image_bytes(url, access)
    return open_image(data if data is not None else _fetched(url, access))


async def load_image_bytes(url: Any, client: Any, access: MediaAccess) -> bytes:
    """The bytes of the image an `image_url` names, fetched with `client` (`fetch_client(access,
    asynchronous=True)`) where it is an http(s) URL."""
    if isinstance(url, str) and url.startswith("file:"):
        return await asyncio.to_thread(_local_file, url, access)
    data = inline_image_bytes(url, access)
    if data is not None:
        return data
    import httpx

    try:
        async with client.stream("GET", url) as response:
            response.raise_for_status()
            return await _bounded(response.aiter_bytes(), url)
    except httpx.HTTPError as exc:
        raise ValueError(f"image_url: fetching {url} failed: {exc}") from None


def inline_image_bytes(url: Any, access: MediaAccess) -> bytes | None:
    """A data URL's bytes, or a file: URL's under the allowed folder; None for an http(s) URL (to be
    fetched by a `fetch_client`, which checks its hosts); ValueError for anything else."""
    if not isinstance(url, str):
        raise ValueError(f"image_url.url must be a string, got {type(url).__name__}")
    if url.startswith(("http://", "https://")):
        return None
    if url.startswith("file:"):
        return _local_file(url, access)
    if not url.startswith("data:"):
        scheme = url.partition(":")[0] if ":" in url else url[:20]
        raise ValueError(f"image_url: URLs of scheme {scheme!r} are not implemented (data:, http(s): and, with "
                         "--allowed-local-media-path, file: URLs are)")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError("image_url: a data URL must be base64-encoded (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"image_url: the data URL is not valid base64: {exc}") from None


def fetch_client(access: MediaAccess, asynchronous: bool) -> Any:
    """The httpx client (an AsyncClient where `asynchronous`) image fetches go through: vLLM's
    timeout and redirect setting, and, with --allowed-media-domains, a hook that checks the host of
    every request it sends (a redirect's too) before it is sent."""
    import httpx

    def check(request: Any) -> None:
        _check_host(str(request.url), access)

    async def check_async(request: Any) -> None:
        check(request)
    hooks = {} if access.domains is None else {"request": [check_async if asynchronous else check]}
    client = httpx.AsyncClient if asynchronous else httpx.Client
    return client(timeout=access.fetch_timeout_s, follow_redirects=access.follow_redirects, event_hooks=hooks)


def _check_host(url: str, access: MediaAccess) -> None:
    """An http(s) URL's host must be one of --allowed-media-domains, where they are given."""
    host = (urlsplit(url).hostname or "").lower()
    if access.domains is not None and host not in access.domains:
        raise ValueError(f"image_url: the host {host!r} of {url} is not one of --allowed-media-domains "
                         f"{list(access.domains)}")


def open_image(data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"the image could not be decoded: {exc}") from None
    return image


def _local_file(url: str, access: MediaAccess) -> bytes:
    """vLLM's file: URLs: a file under --allowed-local-media-path (its real path, links resolved)."""
    if access.local_folder is None:
        raise ValueError("image_url: file: URLs are read only with --allowed-local-media-path (vLLM's), "
                         "which this server was not given")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"image_url: a file: URL names a file on this machine (file:///path), got {url}")
    path = Path(unquote(parts.path)).resolve()
    folder = Path(access.local_folder)
    if folder not in path.parents:
        raise ValueError(f"image_url: {path} is not under --allowed-local-media-path {folder}")
    try:
        _check_size(path.stat().st_size, url)
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"image_url: {url} could not be read: {exc.strerror or exc}") from None


def _fetched(url: str, access: MediaAccess) -> bytes:
    import httpx

    try:
        with fetch_client(access, asynchronous=False) as client, client.stream("GET", url) as response:
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
