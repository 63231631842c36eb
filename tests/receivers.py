"""A webhook receiver on loopback for in-process tests: it answers every POST 200 and keeps each
request's headers (lower-cased) and body, in order (`received`) and by path (`at`)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

Request = tuple[dict[str, str], str]  # headers, body


class Receiver(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.received: list[Request] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def at(self, path: str) -> list[Request]:
        with self.lock:
            return [r for p, r in zip(self.paths, self.received, strict=True) if p == path]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
        with self.server.lock:
            self.server.paths.append(self.path)
            self.server.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def receiving() -> Iterator[Receiver]:
    server = Receiver()
    # A short poll: `shutdown()` waits for the loop to look (0.5 s by default).
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
