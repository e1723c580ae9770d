"""Errors raised by the hashing package."""


class InvalidImageError(ValueError):
    """An image payload that cannot be keyed: not an image, truncated, too large or unsupported.

    The gateway turns this into an HTTP 400 (``invalid_request_error``). The message names the
    problem (e.g. ``"image has 1000000000 pixels, over the limit of 50000000"``) and never
    echoes the payload.
    """
