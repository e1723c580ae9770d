"""A Hugging Face Hub model, fetched into the standard HF cache with huggingface_hub.

``snapshot_download`` does the work and owns the conventions: the cache (``HF_HOME`` /
``HF_HUB_CACHE``, ``models--org--name/snapshots/<commit>/`` with ``refs/<revision>``), the
token (``HF_TOKEN`` or ``hf auth login``), the endpoint (``HF_ENDPOINT``) and offline mode
(``HF_HUB_OFFLINE=1``: the cache only, no request). What is added here: only the files the engine
reads are fetched, and every way the fetch can fail becomes one line that says what was tried and
what to do (``engine.models.source.ModelSourceError``), never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from loraplex.engine.models.source import ModelSourceError

#: The files the engine reads: config and weights (safetensors only), tokenizer and processor
#: files (``tokenizer.json``, ``tokenizer.model``, ``merges.txt``, ``chat_template.jinja``...).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
#: Copies the engine never reads: Meta's and Mistral's original-format weights, next to the
#: transformers ones in many repositories (a second full copy of the model).
IGNORE_PATTERNS = ["original/*", "consolidated*.safetensors"]


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and its ``__cause__`` chain, outermost first (the last: the refused connection)."""
    chain = [exc]
    while chain[-1].__cause__ is not None and len(chain) < 16:
        chain.append(chain[-1].__cause__)
    return chain


def _http_said(exc) -> str:
    """An ``HfHubHTTPError`` as ``HTTP 503: <the Hub's message>``."""
    status = exc.response.status_code if exc.response is not None else "error"
    message = getattr(exc, "server_message", None)
    return f"HTTP {status}" + (f": {_one_line(message, 120)}" if message else "")


def download_snapshot(
    repo_id: str,
    revision: str | None = None,
    *,
    label: str = "model",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """The local snapshot directory of a Hub model, downloaded into the HF cache if needed.

    Args:
        repo_id: ``org/name`` (or ``name``).
        revision: A branch, tag or commit; None: ``main``.
        label: What the model is in messages (``model``, ``speculative model``).
        progress: Told one line before the fetch starts.

    Returns:
        ``HF_HUB_CACHE/models--org--name/snapshots/<commit>``.

    Raises:
        ModelSourceError: the Hub cannot be reached and the cache lacks the revision, offline
            mode and a cache without it, no such repository or revision, no access (401, a
            gated model), any other HTTP error, a download that fails on disk, or a snapshot
            with no safetensors weights.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    rev = revision or "main"
    what = f"{label} {repo_id!r} (no such local path; as a Hugging Face Hub id, revision {rev!r})"
    cache = constants.HF_HUB_CACHE
    command = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    fetch = f"pre-download it (`{command}`) into that cache"
    offline = bool(constants.HF_HUB_OFFLINE)
    if progress is not None:
        where = "the HF cache only (HF_HUB_OFFLINE)" if offline else constants.ENDPOINT
        progress(f"fetching {label} {repo_id} (revision {rev}) from {where} into {cache}")
    pinned = _cached_commit_snapshot(cache, repo_id, revision) if offline else None
    try:
        path = pinned or snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    except GatedRepoError:
        raise ModelSourceError(
            f"{what} is gated: accept its terms at {constants.ENDPOINT}/{repo_id} and set HF_TOKEN "
            "to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        token = "HF_TOKEN is set but cannot read it" if _has_token() else "no HF_TOKEN is set"
        raise ModelSourceError(
            f"{what}: no such repository on the Hub, or it is private ({token}): check the id, "
            "set HF_TOKEN to a token that can read it, or pass a local directory"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(
            f"{what}: the repository has no revision {rev!r}: give --revision a branch, tag or "
            "commit of it"
        ) from None
    except LocalEntryNotFoundError as exc:  # not in the cache, and the Hub was not asked
        if offline:
            raise ModelSourceError(
                f"{what}: HF_HUB_OFFLINE is set and the HF cache ({cache}) does not hold it: "
                f"{fetch}, unset HF_HUB_OFFLINE, or pass a local directory"
            ) from None
        chain = _causes(exc)
        answered = [c for c in chain if isinstance(c, HfHubHTTPError)]
        if answered:  # the Hub answered, with an error (a 5xx: it is down)
            reason = f"the Hub at {constants.ENDPOINT} answered {_http_said(answered[0])}"
        else:
            reason = f"cannot reach the Hub at {constants.ENDPOINT} ({_one_line(chain[-1], 120)})"
        raise ModelSourceError(
            f"{what}: {reason}, and the HF cache ({cache}) does not hold it: check the network "
            f"or HF_ENDPOINT, {fetch}, or pass a local directory"
        ) from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        said = _http_said(exc)
        if status == 401:  # the Hub's answer to a token it does not accept
            raise ModelSourceError(
                f"{what}: the Hub refused the token ({said}): set HF_TOKEN to a valid token, or "
                "unset it for a public model"
            ) from None
        raise ModelSourceError(f"{what}: the Hub refused the download ({said})") from None
    except OSError as exc:
        message = f"{what}: downloading into {cache} failed: {_one_line(exc)}"
        raise ModelSourceError(message) from None
    except Exception as exc:  # httpx's proxy and protocol errors reach here unwrapped
        raise ModelSourceError(
            f"{what}: the download failed ({type(exc).__name__}: {_one_line(exc)}): check the "
            f"network, {fetch}, or pass a local directory"
        ) from None
    path = Path(path)
    if not any(path.rglob("*.safetensors")):
        raise ModelSourceError(
            f"{what} has no safetensors weights ({path}): loraplex loads safetensors only "
            "(a GGUF repository: download its .gguf file and pass that file)"
        )
    return path


def _cached_commit_snapshot(cache: str, repo_id: str, revision: str | None) -> str | None:
    """Offline, a full commit hash whose snapshot the cache holds: that snapshot's directory.

    huggingface_hub 1.x's ``snapshot_download`` asks the Hub for the file list of a commit
    revision even offline (and fails); 2.x answers from the cache. A commit's snapshot never
    changes, so it is read from the cache directly (seen on the GPU image, docs/gpu.md).
    """
    if (
        revision is None
        or len(revision) != 40
        or any(c not in "0123456789abcdef" for c in revision)
    ):
        return None
    folder = Path(cache) / ("models--" + repo_id.replace("/", "--")) / "snapshots" / revision
    return str(folder) if folder.is_dir() else None


def _has_token() -> bool:
    """Whether huggingface_hub has a token (``HF_TOKEN`` or a stored login)."""
    from huggingface_hub import get_token

    return bool(os.environ.get("HF_TOKEN") or get_token())
