"""A Conveyor webhook receiver: verify the signature, handle each event once, answer at once.

    CONVEYOR_WEBHOOK_SECRET=whsec_... PORT=8080 python webhook_receiver.py
"""

import base64
import hashlib
import hmac
import json
import os
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

TOLERANCE_S = 300  # refuse deliveries signed more than 5 minutes from now (replays)
seen: set[str] = set()  # webhook-ids already handled (keep them in your database)


def verify(secret: str, headers, body: bytes, now: float | None = None) -> dict:
    """The event, if `body` was signed with `secret` (`whsec_<base64>`) less than 5 minutes ago."""
    msg_id = headers.get("webhook-id")
    stamp = headers.get("webhook-timestamp")
    signatures = headers.get("webhook-signature")
    if not (msg_id and stamp and signatures):
        raise ValueError("missing webhook headers")
    if abs((time.time() if now is None else now) - int(stamp)) > TOLERANCE_S:
        raise ValueError("timestamp too old or in the future")
    key = base64.b64decode(secret.removeprefix("whsec_"))
    digest = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    expected = base64.b64encode(digest).decode()
    for signature in signatures.split():  # one per secret the sender holds (rotation)
        version, _, value = signature.partition(",")
        if version == "v1" and hmac.compare_digest(value, expected):
            return json.loads(body)
    raise ValueError("no signature matches")


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        try:
            event = verify(os.environ["CONVEYOR_WEBHOOK_SECRET"], self.headers, body)
        except ValueError as exc:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(str(exc).encode())
            return
        if self.headers["webhook-id"] not in seen:  # a retry repeats the id
            seen.add(self.headers["webhook-id"])
            print(event["type"], event["data"].get("id"), flush=True)  # queue your work here
        self.send_response(204)
        self.end_headers()


if __name__ == "__main__":
    server = HTTPServer(("0.0.0.0", int(os.environ.get("PORT", "8080"))), Receiver)
    print("listening on", server.server_port, flush=True)
    server.serve_forever()
