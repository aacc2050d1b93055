"""An app from `build_server` served in this process, for the tests that talk HTTP to it."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


@contextlib.contextmanager
def running_server(app: Any, front: Any = None) -> Iterator[str]:
    """`app` served by uvicorn on a free loopback port in a daemon thread -> its base URL
    (`http://127.0.0.1:PORT`); on exit the server stops and `front` (build_server's) shuts down."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        if front is not None:
            front.shutdown()
