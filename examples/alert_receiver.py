"""A receiver of toolledger's alert webhook: checks each alert's signature, drops repeats by
the alert's id, and prints what happened to which call (with the link to its page).

    export TOOLLEDGER_ALERT_WEBHOOK_SECRET=...   # the same secret `toolledger serve` has
    python examples/alert_receiver.py --port 8787

then run `toolledger serve` with TOOLLEDGER_ALERT_WEBHOOK_URL=http://127.0.0.1:8787/alerts.
A real receiver pages someone, opens a ticket or posts to a chat where this one prints, and
keeps the ids it has handled in its own database (here: in memory, lost when it stops).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Lock

from toolledger import verify_alert_signature


def handler_for(secret: str) -> type[BaseHTTPRequestHandler]:
    handled: set[str] = set()
    lock = Lock()

    class AlertHandler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            # The raw bytes, as received: re-encoding the JSON would change what was signed.
            if not verify_alert_signature(body, self.headers.get("X-Toolledger-Signature"), secret):
                self._answer(401)
                return
            alert = json.loads(body)
            with lock:
                repeat = alert["id"] in handled
                handled.add(alert["id"])
            if not repeat:  # at least once: a repeat has the same id, and is answered all the same
                call = alert["call"]
                key = f"{call['session_id']}/{call['turn_id']}/{call['call_id']}"
                line = f"{alert['kind']}: {call['tool']} {key} ({call['status']}): {alert['reason']}"
                print(f"{line} {alert.get('url', '')}".rstrip(), flush=True)
            self._answer(204)

        def _answer(self, status: int) -> None:
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    return AlertHandler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8787, help="0 picks a free one")
    args = parser.parse_args()
    secret = os.environ.get("TOOLLEDGER_ALERT_WEBHOOK_SECRET", "")
    if not secret:
        sys.exit("set TOOLLEDGER_ALERT_WEBHOOK_SECRET to the secret toolledger signs alerts with")
    server = ThreadingHTTPServer((args.host, args.port), handler_for(secret))
    print(f"receiving alerts at http://{args.host}:{server.server_address[1]}/alerts", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
