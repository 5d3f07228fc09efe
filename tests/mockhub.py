"""A small in-process stand-in for the Hugging Face Hub file API, for download tests.

It implements what the real `huggingface_hub` client (2.x) needs to fetch a file:

* ``HEAD``/``GET /{prefix}{repo}/resolve/{revision}/{filename}`` where prefix is ``datasets/`` for
  dataset repos and empty for model repos. Every answer carries ``X-Repo-Commit``.
* LFS-like files (the default, like parquet shards on the Hub) answer ``302`` with
  ``X-Linked-Etag: "<sha256>"``, ``X-Linked-Size`` and a ``Location`` on another host name
  (``localhost`` instead of ``127.0.0.1``), which the client treats as a CDN: it does not follow the
  redirect on HEAD and does not forward the ``Authorization`` header there.
* Plain (non-LFS) files answer ``200`` with ``ETag: "<git blob sha1>"`` and the bytes.
* Content answers honour ``Range: bytes=a-`` / ``bytes=a-b`` (``206`` + ``Content-Range``), which is
  how the client resumes a partial download, and advertise ``Accept-Ranges: bytes``.
* Unknown repo / revision / file answer ``404`` with the ``X-Error-Code`` the Hub sends
  (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``).

Faults are injected per file with :meth:`MockHub.fault`; each is a count of requests it affects:
``errors`` (answer HTTP 500), ``short`` (send half the requested bytes with a matching
Content-Length: a clean but truncated body), ``drop`` (promise the full Content-Length, send half,
close the connection) and ``corrupt`` (flip one byte, keeping the advertised sha256).

Every request is recorded in :attr:`MockHub.requests` (method, path, Range, Authorization) so tests
can check that a rerun resumed with a Range request or that a token stayed off the CDN.

The server binds 127.0.0.1 on a free port, handles each connection in a daemon thread with a socket
timeout, and stops when the ``with`` block (or :meth:`stop`) ends, or at the latest after
``max_lifetime`` seconds so a forgotten server cannot outlive its test for long.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

FAULTS = ("errors", "short", "drop", "corrupt")


@dataclass
class HubFile:
    content: bytes
    lfs: bool = True
    faults: dict = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def git_sha1(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()


class MockHub:
    """A fake Hub serving files of one or more repos at a single commit (also reachable as `main`).

    Assigning :attr:`commit` moves `main` to a new commit (requests for the old commit then answer
    404 RevisionNotFound); :meth:`add_file` on an existing name changes that file.

    >>> with MockHub() as hub:
    ...     hub.add_file("org/data", "shard_00000.parquet", data)
    ...     os.environ["HF_ENDPOINT"] = hub.url
    """

    def __init__(self, repo_type: str = "dataset", commit: str = "c0ffee" * 6 + "abcd", max_lifetime: float = 300.0):
        self.repo_type = repo_type
        self.commit = commit
        self.files: dict[tuple[str, str], HubFile] = {}
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._deadline = threading.Timer(max_lifetime, self.stop)
        self._deadline.daemon = True

    # ------------------------------------------------------------------ setup
    def add_file(self, repo: str, filename: str, content: bytes, *, lfs: bool = True) -> HubFile:
        f = HubFile(content, lfs)
        self.files[(repo, filename)] = f
        return f

    def fault(self, repo: str, filename: str, **counts: int) -> None:
        """Set fault counts for a file, e.g. ``fault(repo, name, errors=2)``; 0 clears one."""
        unknown = set(counts) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        with self._lock:
            self.files[(repo, filename)].faults.update(counts)

    def take_fault(self, f: HubFile, kind: str) -> bool:
        """Consume one occurrence of a fault; True if it applies to this request."""
        with self._lock:
            if f.faults[kind] > 0:
                f.faults[kind] -= 1
                return True
            return False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MockHub:
        self._thread.start()
        self._deadline.start()
        return self

    def stop(self) -> None:
        self._deadline.cancel()
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> MockHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ routing
    def resolve(self, path: str) -> tuple[str, str, str] | None:
        """`/datasets/org/name/resolve/rev/a/b.parquet` -> (repo, revision, filename), None if not a resolve path."""
        prefix = "/datasets/" if self.repo_type == "dataset" else "/"
        if not path.startswith(prefix):
            return None
        parts = path[len(prefix):].split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return None
        return f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:]))

    def blob(self, sha256: str) -> HubFile | None:
        return next((f for f in self.files.values() if f.sha256 == sha256), None)

    def requests_for(self, filename: str, method: str = "GET") -> list[dict]:
        return [r for r in self.requests if r["method"] == method and r["path"].endswith(filename)]


def _handler_for(hub: MockHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 10  # a stuck client connection ends its thread instead of holding it forever

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        # -------------------------------------------------------------- helpers
        def _serve(self, body: bool) -> None:
            path = urlsplit(self.path).path
            with hub._lock:
                hub.requests.append({
                    "method": self.command,
                    "path": path,
                    "range": self.headers.get("Range"),
                    "authorization": self.headers.get("Authorization"),
                })
            if path.startswith("/cdn/"):
                f = hub.blob(path.rsplit("/", 1)[-1])
                if f is None:
                    return self._error(404, "EntryNotFound")
                if hub.take_fault(f, "errors"):
                    return self._error(500)
                return self._content(f, body, {})
            target = hub.resolve(path)
            if target is None:
                return self._error(404, "RepoNotFound")
            repo, revision, filename = target
            if not any(r == repo for r, _ in hub.files):
                return self._error(404, "RepoNotFound")
            if revision not in ("main", hub.commit):
                return self._error(404, "RevisionNotFound")
            f = hub.files.get((repo, filename))
            if f is None:
                return self._error(404, "EntryNotFound")
            if hub.take_fault(f, "errors"):
                return self._error(500)
            if f.lfs:
                # Real Hub: LFS files redirect to a CDN host; the linked etag is the content sha256.
                return self._send(302, {
                    "Location": f"http://localhost:{hub.port}/cdn/{f.sha256}",
                    "ETag": f'"{f.git_sha1}"',
                    "X-Linked-Etag": f'"{f.sha256}"',
                    "X-Linked-Size": str(len(f.content)),
                    "Content-Length": "0",
                })
            return self._content(f, body, {"ETag": f'"{f.git_sha1}"'})

        def _content(self, f: HubFile, body: bool, headers: dict) -> None:
            data = f.content
            if body and hub.take_fault(f, "corrupt"):
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start, end, status = 0, len(data) - 1, 200
            rng = self.headers.get("Range")
            if rng:
                a, _, b = rng.removeprefix("bytes=").partition("-")
                start, end, status = int(a), int(b) if b else len(data) - 1, 206
                if start >= len(data):
                    return self._send(416, {"Content-Range": f"bytes */{len(data)}", "Content-Length": "0"})
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            chunk = data[start:end + 1]
            headers.update({"Accept-Ranges": "bytes", "Content-Length": str(len(chunk))})
            if not body:
                return self._send(status, headers)
            if hub.take_fault(f, "short"):
                chunk = chunk[: len(chunk) // 2]
                headers["Content-Length"] = str(len(chunk))
                if rng:
                    headers["Content-Range"] = f"bytes {start}-{start + len(chunk) - 1}/{len(data)}"
            elif hub.take_fault(f, "drop"):
                self.close_connection = True
                chunk = chunk[: len(chunk) // 2]
            self._send(status, headers, chunk)

        def _error(self, status: int, code: str | None = None) -> None:
            headers = {"Content-Length": "0"}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, headers)

        def _send(self, status: int, headers: dict, payload: bytes = b"") -> None:
            self.send_response(status)
            self.send_header("X-Repo-Commit", hub.commit)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if payload:
                self.wfile.write(payload)

    return Handler
