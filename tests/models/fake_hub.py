"""A Hugging Face Hub on loopback, and a pre-populated HF cache, for the model-source tests.

The machine has no network, so huggingface_hub's real client (``snapshot_download``) is pointed
at :class:`FakeHub` (``HF_ENDPOINT``), which answers the three calls a snapshot download makes
(the revision's info, the file tree, each file) and the Hub's error answers: 404 with
``X-Error-Code: RepoNotFound`` or ``RevisionNotFound``, 403 ``GatedRepo``, 401 for a private
repository without a token (``RepoNotFound``) or with a wrong one (``Invalid credentials``).
:func:`cache_snapshot` writes the cache layout huggingface_hub reads offline
(``models--org--name/snapshots/<commit>/`` and ``refs/<revision>``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

Files = dict[str, bytes]


def model_files(directory: Path) -> Files:
    """A model directory's files, by name."""
    return {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()}


def cache_snapshot(hub_cache: Path, repo_id: str, commit: str, files: Files, refs=("main",)):
    """Write ``files`` as the cached snapshot ``commit`` of ``repo_id``, named by ``refs``.

    Returns:
        The snapshot directory.
    """
    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


class FakeHub:
    """An HTTP server that answers as the Hub does for the repositories it is given.

    Args:
        repos: ``{repo_id: {revision: (commit, files)}}``.
        token: When set, every request needs ``Authorization: Bearer <token>``.
        gated: Repositories that answer 403 ``GatedRepo``.
        broken: Repositories that answer 503 (a Hub that is down).

    Attributes:
        url: ``http://127.0.0.1:<port>`` (the ``HF_ENDPOINT``).
        requests: ``(method, path, authorization header)`` of every request, in order.
    """

    def __init__(self, repos: dict, *, token: str | None = None, gated=(), broken=()) -> None:
        self.repos, self.token, self.gated, self.broken = repos, token, set(gated), set(broken)
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, head=True)

            def do_GET(self):
                hub._answer(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.02,), daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloaded(self) -> list[str]:
        """The file paths fetched with GET, in order."""
        return [
            p.split("/resolve/", 1)[1].split("/", 1)[1]
            for m, p, _ in self.requests
            if m == "GET" and "/resolve/" in p
        ]

    def _find(self, repo_id: str, revision: str):
        revisions = self.repos.get(repo_id)
        if revisions is None:
            return None, None
        for name, (commit, files) in revisions.items():
            if revision in (name, commit):
                return commit, files
        return False, None

    def _answer(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlparse(h.path).path)
        auth = h.headers.get("authorization")
        self.requests.append((h.command, path, auth))

        def send(code: int, body: bytes = b"", headers=()) -> None:
            h.send_response(code)
            for key, value in headers:
                h.send_header(key, value)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if not head:
                h.wfile.write(body)

        if self.token and auth != f"Bearer {self.token}":
            if auth is None:  # a private repository, to the anonymous
                return send(401, b"{}", [("X-Error-Code", "RepoNotFound")])
            message = "Invalid credentials in Authorization header"
            return send(401, b"{}", [("X-Error-Message", message)])
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/") :]
            kind = next((k for k in ("/revision/", "/tree/") if k in rest), None)
            if kind is None:
                return send(404)
            repo_id, revision = rest.split(kind, 1)
        elif "/resolve/" in path:
            repo_id, rest = path.strip("/").split("/resolve/", 1)
            revision, file = rest.split("/", 1)
            kind = "file"
        else:
            return send(404)
        if repo_id in self.broken:
            return send(503, b"{}", [("X-Error-Message", "The Hub is down for maintenance")])
        if repo_id in self.gated:
            return send(403, b"{}", [("X-Error-Code", "GatedRepo")])
        commit, files = self._find(repo_id, revision)
        if commit is None:
            return send(404, b"{}", [("X-Error-Code", "RepoNotFound")])
        if commit is False:
            return send(404, b"{}", [("X-Error-Code", "RevisionNotFound")])
        if kind == "/revision/":
            info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
            return send(200, json.dumps(info).encode(), [("Content-Type", "application/json")])
        if kind == "/tree/":
            tree = [
                {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for f, b in files.items()
            ]
            return send(200, json.dumps(tree).encode(), [("Content-Type", "application/json")])
        if file not in files:
            return send(404, b"{}", [("X-Error-Code", "EntryNotFound")])
        body = files[file]
        etag = '"' + hashlib.sha1(body).hexdigest() + '"'
        return send(200, body, [("X-Repo-Commit", commit), ("ETag", etag)])
