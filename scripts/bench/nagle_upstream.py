#!/usr/bin/env python3
"""An upstream that answers the way Python's http.server and many small servers do: keep-alive
HTTP/1.1, headers and body written in two separate sends, TCP_NODELAY off (Nagle on).

Usage: nagle_upstream.py PORT  (listens on 127.0.0.1)
"""
import http.server
import sys


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        body = b'{"ok": true}\n'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()  # first send: status line and headers
        self.wfile.write(body)  # second send: the body

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.serve_forever()
