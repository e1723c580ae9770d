"""The ``POST /v1/adapters`` form: a name and the adapter's two files, loose or in one archive.

``multipart/form-data`` (docs/adapters.md) with ``name`` and either two ``files`` parts, told apart
by their file names (``adapter_config.json``, ``adapter_model.safetensors``; a client's directory
prefix is dropped), or one ``archive`` part (see :mod:`gateway.domains.adapters.archive`). Other
fields and other ``files`` parts are ignored, as the archive ignores other entries; weights sent
only as a pickle file are refused by name. The body is parsed as it streams, its file parts spooled
to disk under per-part caps (:mod:`gateway.domains.adapters.form`); the two files are read back (or
unpacked from the archive) in a worker thread once a processing slot is free.
"""

from __future__ import annotations

import os
import re

from loraplex.adapters.safetensors_io import PICKLE_SUFFIXES
from loraplex.adapters.validation import CONFIG_NAME, WEIGHTS_NAME
from loraplex.gateway.domains.adapters.archive import ArchiveError, unpack_adapter
from loraplex.gateway.domains.adapters.form import UploadForm
from loraplex.gateway.domains.adapters.limits import UploadLimits
from loraplex.gateway.errors import APIError, bad_request

NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_name(value: object) -> str:
    """The adapter name: ``^[A-Za-z0-9._-]{1,64}$``, and neither ``.`` nor ``..``.

    Raises:
        APIError: 400 with param ``name``.
    """
    if value is None:
        raise bad_request("the 'name' field is required", param="name")
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise bad_request(
            "'name' must be 1 to 64 characters from A-Z, a-z, 0-9, '.', '_' and '-'",
            param="name",
        )
    if value in (".", ".."):
        raise bad_request(f"'name' cannot be {value!r}", param="name")
    return value


def check_shape(form: UploadForm) -> str:
    """Which kind of upload the form is: ``"files"`` or ``"archive"``.

    Raises:
        APIError: 400 for neither or both kinds of parts, a missing file, or pickle weights.
    """
    if (form.files or form.other_files) and form.archives:
        raise bad_request("send either 'files' parts or one 'archive' part, not both")
    if form.archives:
        return "archive"
    if not form.files and not form.other_files:
        raise bad_request(
            f"send the adapter as two 'files' parts ({CONFIG_NAME}, {WEIGHTS_NAME}) or one "
            "'archive' part (.zip or .tar.gz)",
            param="files",
        )
    if WEIGHTS_NAME not in form.files:
        pickles = sorted(n for n in form.other_files if n.lower().endswith(PICKLE_SUFFIXES))
        if pickles:
            raise bad_request(
                f"adapter weights {pickles[0]} are a pickle file; only {WEIGHTS_NAME} is "
                "accepted (save with safe_serialization=True)",
                param="files",
                code="invalid_adapter",
            )
    for required in (CONFIG_NAME, WEIGHTS_NAME):
        if required not in form.files:
            raise bad_request(f"no 'files' part named {required}", param="files")
    return "files"


def adapter_bytes(
    form: UploadForm, kind: str, limits: UploadLimits, spool_dir: str | os.PathLike[str]
) -> tuple[bytes, bytes]:
    """``(adapter_config.json, adapter_model.safetensors)``, each read once into one buffer.

    Blocking (disk reads, decompression): run it in a worker thread.

    Raises:
        APIError: 400 (param ``archive``) for an archive refused by the archive policy.
    """
    if kind == "files":
        return form.files[CONFIG_NAME].read(), form.files[WEIGHTS_NAME].read()
    archive = form.archives[0]
    assert archive.file is not None
    try:
        return unpack_adapter(
            archive.file,
            max_members=limits.members,
            max_unpacked_bytes=limits.unpacked_bytes,
            member_caps={CONFIG_NAME: limits.config_bytes, WEIGHTS_NAME: limits.weights_bytes},
            spool_dir=spool_dir,
        )
    except ArchiveError as exc:
        raise APIError(400, str(exc), param="archive", code="invalid_archive") from None
