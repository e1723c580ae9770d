"""Chat messages in, prompt token ids and processed images out, exactly as transformers does it.

The prompt comes from the model directory's own processor (LLaVA) or tokenizer (text-only)
through ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
return_dict=True)``, as transformers renders it. Messages are first put in the form the
template expects:
string content for a template that renders ``message['content']`` itself, a list of parts for
one that iterates over the content (detected from the template's syntax tree, as vLLM's
content-format detection does). ``image_url`` parts must be ``data:`` URLs (never fetched).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any, Literal

import jinja2
import jinja2.nodes
import torch

from loraplex.engine.client.image_inputs import placeholder_runs, split_images
from loraplex.engine.request import ImageInput
from loraplex.hashing.errors import InvalidImageError
from loraplex.hashing.extra_keys import MMPlaceholder
from loraplex.hashing.image_decode import (
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_REQUEST_IMAGE_PIXELS,
    check_image_header,
)
from loraplex.hashing.image_header import ImageHeader
from loraplex.hashing.image_keys import (
    DEFAULT_MAX_ASPECT_RATIO,
    DEFAULT_MAX_PIXELS,
    decode_image,
    image_key,
)

ContentFormat = Literal["string", "parts"]
_DATA_MIME = ("image/png", "image/jpeg", "image/jpg", "image/webp")


def detect_content_format(chat_template: str | None) -> ContentFormat:
    """Whether a chat template iterates over ``message['content']`` (``"parts"``) or not.

    Looks in the template's Jinja syntax tree for a ``for`` loop over a ``content`` item or
    attribute, through filters (``message['content'] | selectattr(...)``) and through
    variables assigned from it (``{% set parts = message['content'] %}``). Templates that do
    not parse count as ``"string"``.
    """
    if not chat_template:
        return "string"
    try:
        tree = jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return "string"
    content_vars: set[str] = set()
    for assign in tree.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and _is_content(assign.node, set()):
            content_vars.add(assign.target.name)
    for loop in tree.find_all(jinja2.nodes.For):
        if _is_content(loop.iter, content_vars):
            return "parts"
    return "string"


def _is_content(node: jinja2.nodes.Node, content_vars: set[str]) -> bool:
    """``X['content']``, ``X.content``, a variable holding it, or a filter over one of them."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        return node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in content_vars


def parse_data_url(url: str) -> bytes:
    """Decode a ``data:image/(png|jpeg|webp);base64,...`` URL.

    Raises:
        ValueError: another scheme, another media type, or invalid base64.
    """
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(
            "image_url must be a data: URL (data:image/png;base64,...); remote URLs are not fetched"
        )
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ValueError("malformed data: URL (no comma)")
    mime, _, encoding = header.partition(";")
    if mime.lower() not in _DATA_MIME:
        raise ValueError(f"unsupported image media type {mime!r}; use png, jpeg or webp")
    if encoding.lower() != "base64":
        raise ValueError("image data: URLs must be base64-encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image data: URL holds invalid base64") from None


@dataclass
class ProcessedPrompt:
    """A prompt ready for the engine.

    Attributes:
        prompt_token_ids: Token ids, image placeholders expanded.
        images: One per image, in placeholder order.
    """

    prompt_token_ids: list[int]
    images: list[ImageInput]


class InputProcessor:
    """Turns OpenAI-style chat messages into a :class:`ProcessedPrompt`.

    Args:
        processor: The directory's ``AutoProcessor`` (LLaVA) or ``AutoTokenizer`` (text-only).
        image_token_id: The image placeholder token id, None for a text-only model.
        num_image_tokens: Placeholder tokens per image; 0 when it varies with the image (a
            transformers vision-language model: each image's span and inputs come from its
            processor's outputs, ``engine.client.image_inputs``).
        mm_hash: Image key mode, ``"exact"`` (default) or ``"perceptual"``.
        max_image_pixels: Most pixels in one image (``width * height`` from its header).
        max_images: Most images in one request.
        max_image_aspect_ratio: Largest longer-side-over-shorter-side of one image
            (``hashing.image_decode.DEFAULT_MAX_ASPECT_RATIO`` has the arithmetic).
        max_request_image_pixels: Most pixels of all of one request's images together.

    Every image bound is checked on the sizes the images' headers state, for all of a
    request's images, before any of them is decoded; a refusal is a ``ValueError`` (an
    ``InvalidImageError`` for a bad image) whose message names the message part.
    """

    def __init__(
        self,
        processor: Any,
        *,
        image_token_id: int | None,
        num_image_tokens: int = 0,
        mm_hash: str = "exact",
        max_image_pixels: int = DEFAULT_MAX_PIXELS,
        max_images: int = DEFAULT_MAX_IMAGES,
        max_image_aspect_ratio: float = DEFAULT_MAX_ASPECT_RATIO,
        max_request_image_pixels: int = DEFAULT_MAX_REQUEST_IMAGE_PIXELS,
    ) -> None:
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.image_token_id = image_token_id
        self.num_image_tokens = num_image_tokens
        self.mm_hash = mm_hash
        self.max_image_pixels = max_image_pixels
        self.max_images = max_images
        self.max_image_aspect_ratio = max_image_aspect_ratio
        self.max_request_image_pixels = max_request_image_pixels
        template = getattr(processor, "chat_template", None) or getattr(
            self.tokenizer, "chat_template", None
        )
        self.content_format = detect_content_format(template)
        self.chat_template = template if isinstance(template, str) else None

    def normalize(self, messages: Any) -> tuple[list[dict], list]:
        """Validate messages and put them in the template's form.

        Returns:
            The messages for ``apply_chat_template`` and the decoded PIL images in order.

        Raises:
            ValueError: malformed messages, a bad image URL, images for a model or template
                that takes none, more than ``max_images`` images, or more than
                ``max_request_image_pixels`` pixels in all (checked before decoding).
            InvalidImageError: an image out of bounds (from its header) or that does not decode.
        """
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        out, images = [], []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must be an object with a string 'role'")
            content = message.get("content")
            parts: list[dict] = []
            if isinstance(content, str):
                parts.append({"type": "text", "text": content})
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    parts.append(self._part(part, f"messages[{i}].content[{j}]", images))
            elif content is None:
                pass
            else:
                raise ValueError(f"messages[{i}].content must be a string or a list of parts")
            if self.content_format == "parts":
                out.append({**message, "content": parts})
            else:
                if any(p["type"] == "image" for p in parts):
                    raise ValueError("this model's chat template takes no images")
                text = "\n".join(p["text"] for p in parts)
                out.append({**message, "content": text})
        if images and self.image_token_id is None:
            raise ValueError("this model takes no images")
        return out, self._decode_images(images)

    def _decode_images(self, pending: list[tuple[str, bytes, ImageHeader, dict]]) -> list:
        """Check the request's pixel budget on the headers, then decode every image in order."""
        total = sum(header.pixels for _, _, header, _ in pending)
        if total > self.max_request_image_pixels:
            raise ValueError(
                f"too many image pixels: the request's {len(pending)} images have {total} "
                f"pixels in all, over the limit of {self.max_request_image_pixels} per request"
            )
        images = []
        for where, payload, _, entry in pending:
            try:
                entry["image"] = decode_image(
                    payload,
                    max_pixels=self.max_image_pixels,
                    max_aspect_ratio=self.max_image_aspect_ratio,
                )
            except InvalidImageError as exc:
                raise InvalidImageError(f"{where}: {exc}") from None
            images.append(entry["image"])
        return images

    def _part(self, part: Any, where: str, pending: list) -> dict:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f"{where} must be an object with a string 'type'")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.text must be a string")
            return {"type": "text", "text": part["text"]}
        if kind == "image_url":
            if len(pending) >= self.max_images:  # refused before reading one more payload
                raise ValueError(f"too many images: {where} is image {len(pending) + 1} of a "
                                 f"request, at most {self.max_images} are accepted")  # fmt: skip
            spec = part.get("image_url")
            url = spec.get("url") if isinstance(spec, dict) else spec
            try:
                payload = parse_data_url(url)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            try:
                header = check_image_header(
                    payload,
                    max_pixels=self.max_image_pixels,
                    max_aspect_ratio=self.max_image_aspect_ratio,
                )
            except InvalidImageError as exc:
                raise InvalidImageError(f"{where}: {exc}") from None
            entry = {"type": "image", "image": None}  # filled once every header has passed
            pending.append((where, payload, header, entry))
            return entry
        raise ValueError(f"{where} has unsupported type {kind!r} (text or image_url)")

    def __call__(self, messages: Any, tools: list[dict] | None = None) -> ProcessedPrompt:
        """Process chat messages.

        Args:
            messages: OpenAI chat messages.
            tools: OpenAI ``tools`` for the chat template to render (None or empty: none).

        Raises:
            ValueError: bad messages or images, or placeholders that do not match the images.
            InvalidImageError: an image that does not decode (a ValueError too).
        """
        normalized, pil_images = self.normalize(messages)
        variable = pil_images and not self.num_image_tokens
        # A variable-length image's replacement text says how many image tokens are its own.
        extra = {"processor_kwargs": {"return_text_replacement_offsets": True}} if variable else {}
        try:
            encoded = self.processor.apply_chat_template(
                normalized,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt" if pil_images else None,
                **extra,
            )
        except (InvalidImageError, ValueError):
            raise
        except Exception as exc:  # a template or processor error: the input's fault
            raise ValueError(f"could not apply the chat template: {exc}") from exc
        ids = encoded["input_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if variable:
            return self.attach_variable_images(list(ids), pil_images, encoded)
        pixel_values = encoded.get("pixel_values") if pil_images else None
        return self.attach_images(list(ids), pil_images, pixel_values)

    def attach_images(self, ids: list[int], pil_images: list, pixel_values) -> ProcessedPrompt:
        """Pair each placeholder run in ``ids`` with its image and key.

        Raises:
            ValueError: the number or length of placeholder runs does not match the images.
        """
        runs = []
        n = self.num_image_tokens
        if self.image_token_id is not None:
            for offset, length in placeholder_runs(ids, self.image_token_id):
                # Adjacent images make one long run: split it per image when it divides evenly.
                if n and length > n and length % n == 0:
                    runs.extend((offset + k * n, n) for k in range(length // n))
                else:
                    runs.append((offset, length))
        if len(runs) != len(pil_images):
            raise ValueError(
                f"the prompt has {len(runs)} image placeholder(s) but {len(pil_images)} "
                "image(s) were given"
            )
        images = []
        for i, ((offset, length), pil) in enumerate(zip(runs, pil_images, strict=True)):
            if length != self.num_image_tokens:
                raise ValueError(
                    f"image placeholder {i} has {length} tokens, the model needs "
                    f"{self.num_image_tokens}"
                )
            key = image_key(pil, self.mm_hash)
            images.append(ImageInput(key, pixel_values[i], MMPlaceholder(key, offset, length)))
        return ProcessedPrompt(ids, images)

    def attach_variable_images(self, ids: list[int], pil_images: list, encoded) -> ProcessedPrompt:
        """Pair each image with its span and its own processor outputs (a transformers VLM).

        The key is the image's key (``hashing.image_keys``) followed by its variant
        (``ImageSlice.variant``: its token count and small integer inputs).

        Raises:
            ValueError: image tokens or processor outputs that cannot be told apart per image.
        """
        slices = split_images(ids, self.image_token_id, encoded, len(pil_images), self.tokenizer)
        images = []
        for piece, pil in zip(slices, pil_images, strict=True):
            key = f"{image_key(pil, self.mm_hash)}:{piece.variant()}"
            placeholder = MMPlaceholder(key, piece.offset, piece.length)
            images.append(ImageInput(key, piece.pixel_values, placeholder, piece.inputs))
        return ProcessedPrompt(ids, images)
