"""Helpers for the server tests: start `dflash-mlx serve` (or mlx_lm.server) on a free
127.0.0.1 port, and talk to it with the standard library's plain HTTP client."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    headers: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                raw: bytes | None = None, timeout: float = 60):
        """(status, parsed JSON or text) of one request on a fresh connection."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body))
            hdrs = {**self.headers, **(headers or {})}
            if data is not None:
                hdrs.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=data, headers=hdrs)
            r = conn.getresponse()
            text = r.read().decode("utf-8", "replace")
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text
        finally:
            conn.close()

    def post(self, path: str, body, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def events(self, path: str, body, headers: dict | None = None) -> tuple[int, list]:
        """A streamed request read to the end: (status, [event objects..., "[DONE]"])."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        try:
            conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                         headers={"Content-Type": "application/json", **self.headers,
                                  **(headers or {})})
            r = conn.getresponse()
            if r.status != 200:
                return r.status, [json.loads(r.read())]
            assert r.getheader("content-type", "").startswith("text/event-stream")
            out = []
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    payload = line[6:]
                    out.append(payload if payload == "[DONE]" else json.loads(payload))
            return r.status, out
        finally:
            conn.close()

    def health(self) -> dict:
        return self.get("/health")[1]

    def stop(self) -> int:
        """Ctrl-C, as a user would; returns the exit code (130 for a clean stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(args: list[str], log: Path, port: int | None = None, module: str = "dflash_mlx.cli.main",
          serve: bool = True) -> Server:
    """Start a server process in the background (call `wait_ready` before using it)."""
    port = port or free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", module, *(["serve"] if serve else []), *args,
           "--host", HOST, "--port", str(port)]
    f = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=lambda: os.nice(10))
    return Server(proc, port, log)


def wait_ready(server: Server, timeout: float = 60) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited ({server.proc.returncode}):\n"
                               f"{server.log.read_text()}")
        try:
            if server.get("/health", timeout=5)[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready in {timeout} s:\n{server.log.read_text()}")


def clean_tiny_server(tiny, log: Path, *extra: str):
    """A module fixture's body: a server on the tiny pair, yielded ready; afterwards it must have
    stopped cleanly with no traceback (nor a C++ abort) in its log."""
    yield from serving(["--model", str(tiny.target), "--draft", str(tiny.draft),
                        "--log-level", "warning", *extra], log)


def serving(args: list[str], log: Path):
    """A module fixture's body: `serve args`, yielded ready, then stopped; it must have stopped
    cleanly with no traceback (nor a C++ abort) in its log."""
    s = start(args, log)
    try:
        yield wait_ready(s)
    finally:
        code = s.stop()
    assert code in (0, 130), code
    text = log.read_text()
    assert "Traceback" not in text and "terminate" not in text, text[-2000:]


def open_stream(server: Server, path: str, body: dict, headers: dict | None = None):
    """Start a streamed request; return (connection, response) to read lines from."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=60)
    conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json", **server.headers,
                          **(headers or {})})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    return conn, r


def hang_up(conn, response) -> None:
    """Close the client's socket mid-stream (what a client that goes away does)."""
    response.close()
    conn.close()


def wait_for(predicate, timeout: float = 30, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")
