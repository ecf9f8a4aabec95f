"""`dflash-mlx serve`: an OpenAI-compatible HTTP API over the engine (Starlette on uvicorn).

Endpoints: POST /v1/chat/completions, /v1/completions and /v1/responses (SSE streaming or
not), GET /v1/models, /v1/models/{id}, /v1/responses/{id} (DELETE too), /metrics and
/health. Requests are parsed, checked and tokenized on one preparation thread
(the event loop stays free for /health and other clients), then run one at a time by
`worker.Worker`. Every failure is an OpenAI-style error body with a 4xx
or 5xx code; nothing a client sends ends the server. Beyond OpenAI's fields, responses carry
`speculation` (the request's `Stats.as_dict()`: τ, per-position acceptance, drafted and
accepted counts, timings; /health carries it over every request, see docs/stats.md) and
`usage.prompt_tokens_details.cached_tokens` (prompt tokens served from the reused caches).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
import hmac
import os
import queue
import socket
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ..errors import DFlashError
from .answer import Answer
from .messages import chat_prompt
from .metrics import CONTENT_TYPE as METRICS_TYPE, HTTPCounts, render as render_metrics
from .reply import Reply, sse
from .response_events import ResponseStream, sse as response_sse
from .responses import ResponseStore, parse as parse_responses
from .request import (APIError, ServerConfig, check_for_model, completion_limit, error_response,
                      parse_body, prompt_ids, read_body, settings)
from .worker import Busy, Delta, Done, Failed, Job, Worker

__all__ = ["ServerConfig", "bind", "create_app", "serve"]


# A body that stops arriving for this long (shorter than its Content-Length, the client
# waiting) is refused with a 400 instead of holding the request open forever.
BODY_IDLE_S = 10.0


async def _body(request: Request) -> bytes:
    """The request body, each part of it awaited at most BODY_IDLE_S; a body cut short (the
    client waits, or goes away) is a 400, never a hang nor a traceback in the log."""
    async def receive():
        return await asyncio.wait_for(request.receive(), BODY_IDLE_S)

    try:
        return await read_body(Request(request.scope, receive))
    except (TimeoutError, ClientDisconnect) as e:
        size = request.headers.get("content-length")
        expected = f" of the {size} bytes its Content-Length announces" if size else ""
        why = ("the client closed the connection" if isinstance(e, ClientDisconnect)
               else f"nothing more came in {BODY_IDLE_S:g} s")
        raise APIError(400, f"the request body stopped short{expected} ({why})") from None


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.cancel()
            return


async def _next(job: Job, request: Request):
    """The job's next message, cancelling the job if the client disconnects meanwhile."""
    watcher = asyncio.ensure_future(_watch_disconnect(request, job))
    try:
        return await job.messages.get()
    finally:
        watcher.cancel()


async def _stream(job: Job, first, reply: Reply, include_usage: bool):
    try:
        for chunk in reply.start():
            yield chunk
        msg = first
        while True:
            if isinstance(msg, Delta):
                for chunk in reply.chunks(msg):
                    yield chunk
            elif isinstance(msg, Done) and msg.finish_reason == "cancelled":
                yield sse({"error": {"message": "generation stopped: the server is shutting "
                                     "down", "type": "server_error", "param": None,
                                     "code": None}})
                break
            elif isinstance(msg, Done):
                for chunk in reply.end(msg, include_usage):
                    yield chunk
                break
            else:  # failed mid-stream: the status line is gone, so an error event ends it
                yield sse({"error": {"message": msg.message, "type": "server_error",
                                     "param": None, "code": None}})
                break
            msg = await job.messages.get()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # after a disconnect: the worker stops at the next block boundary


async def _response_events(job: Job, first, out: ResponseStream, answer: Answer):
    """The Responses API's stream: its typed events, then the end (no [DONE] line)."""
    try:
        for event in out.start():
            yield response_sse(event)
        msg = first
        while True:
            if isinstance(msg, Delta):
                events = out.feed(answer.feed(msg.text, msg.tokens))
            elif isinstance(msg, Done):
                events = out.feed(answer.finish()) + out.finish(msg, answer.reasoning_tokens)
            else:
                events = out.fail(msg.message)
            for event in events:
                yield response_sse(event)
            if not isinstance(msg, Delta):
                break
            msg = await job.messages.get()
    finally:
        job.cancel()


class Preparer:
    """One daemon thread that parses and tokenizes requests off the event loop.

    One thread, not a pool: a fast tokenizer's special-token switch is shared state, so
    encodes must not overlap. Never ended (like the worker): see `Worker.close`.
    """

    def __init__(self):
        self.calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name="dflash-prepare", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, args, loop, fut = self.calls.get()
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the request's coroutine
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:  # the event loop is gone
                pass

    async def run(self, fn, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.calls.put((fn, args, loop, fut))
        return await fut


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


# -- the application ---------------------------------------------------------------------------

def create_app(worker: Worker, cfg: ServerConfig) -> Starlette:
    """The Starlette app; `worker` must be started (see `serve`)."""
    if cfg.api_key is not None and not cfg.api_key:  # "" must never read as "no key"
        raise DFlashError("the server's API key is empty: give a key, or None for no key")
    pair = worker.pair
    preparer = Preparer()
    store = ResponseStore()  # previous_response_id: recent responses, bounded

    http = HTTPCounts()

    def guarded(handler, auth: bool = True):
        async def endpoint(request: Request):
            try:
                if auth and cfg.api_key is not None and not _authorized(request, cfg.api_key):
                    raise APIError(401, "Incorrect or missing API key: send 'Authorization: "
                                   "Bearer <key>'", code="invalid_api_key")
                response = await handler(request)
            except APIError as e:
                response = e.response()
            http.add(request.url.path, response.status_code)
            return response

        return endpoint

    def prepare(body: dict, chat: bool):
        """(settings, prompt ids, the chat answer's splitter, max tokens) of a request body."""
        opts = settings(body, cfg, chat)
        check_for_model(opts, pair)
        if opts["logprobs"] is not None and getattr(worker, "group", None) is not None:
            # the distributed leader (follower.py) does not ask the engine for them yet
            raise APIError(400, "'logprobs' is not served under mlx.launch yet", "logprobs")
        if chat:
            prompt = chat_prompt(pair, body, cfg)
            ids, answer = prompt.ids, Answer(pair.tokenizer, prompt.ids, prompt.tools)
            if prompt.constraint is not None:  # a forced tool choice
                if opts["sampling"].constraint is not None:
                    raise APIError(400, "tool_choice required or a named function cannot be "
                                   "combined with response_format", "tool_choice")
                opts["sampling"] = replace(opts["sampling"], constraint=prompt.constraint)
        else:
            ids, answer = prompt_ids(pair, body, cfg.special_tokens), None
        return opts, ids, answer, completion_limit(
            opts["max_tokens"], len(ids), pair.target.context_length, cfg.max_tokens)

    async def run(request: Request, opts: dict, ids: list[int], max_tokens: int):
        """Submit the job; (job, its first message, or all its deltas and the end when not
        streamed)."""
        job = Job(ids, opts["sampling"], opts["stop"], max_tokens=max_tokens,
                  logprobs=opts["logprobs"])
        try:
            worker.submit(job)
        except Busy:
            if worker.closing:
                raise APIError(503, "the server is shutting down") from None
            raise APIError(503, f"the server is busy ({worker.jobs.maxsize} requests queued); "
                           "retry later", code="server_busy",
                           headers={"Retry-After": str(worker.retry_after())}) from None
        try:
            first = await _next(job, request)
            if isinstance(first, Failed):
                raise APIError(first.status, first.message)
            if opts["stream"]:
                return job, first, None
            deltas, msg = [], first
            while isinstance(msg, Delta):
                deltas.append(msg)
                msg = await _next(job, request)
        except BaseException:
            job.cancel()  # e.g. the server is shutting down: free the engine
            raise
        if isinstance(msg, Failed):
            raise APIError(msg.status, msg.message)
        if msg.finish_reason == "cancelled":  # shutting down, or its client left
            if worker.closing:
                raise APIError(503, "generation stopped: the server is shutting down")
            raise APIError(499, "the client closed the request")
        return job, deltas, msg

    def event_stream(chunks) -> StreamingResponse:
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def completions(request: Request, chat: bool):
        opts, ids, answer, max_tokens = await preparer.run(
            lambda raw: prepare(parse_body(raw), chat), await _body(request))
        reply = Reply(chat, cfg.model_id, pair.tokenizer, opts["logprobs"], answer)
        job, got, done = await run(request, opts, ids, max_tokens)
        if done is None:
            return event_stream(_stream(job, got, reply, opts["include_usage"]))
        return JSONResponse(reply.full(got, done))

    async def responses(request: Request):
        def parse(raw: bytes):
            req = parse_responses(parse_body(raw), store)
            return req, *prepare(req.chat, True)

        req, opts, ids, answer, max_tokens = await preparer.run(parse, await _body(request))
        out = ResponseStream(cfg.model_id, req, store)
        job, got, done = await run(request, opts, ids, max_tokens)
        if done is None:
            return event_stream(_response_events(job, got, out, answer))
        for d in got:
            out.feed(answer.feed(d.text, d.tokens))
        out.feed(answer.finish())
        out.finish(done, answer.reasoning_tokens)
        return JSONResponse(out.response())

    async def stored_response(request: Request):
        """GET /v1/responses/{id}: the Response as created; DELETE: forget it."""
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return JSONResponse(store.delete(response_id))
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise APIError(400, "'stream' is not supported when retrieving a response: it "
                           "was not created in the background", "stream")
        return JSONResponse(store.response(response_id))

    async def chat_completions(request: Request):
        return await completions(request, chat=True)

    async def text_completions(request: Request):
        return await completions(request, chat=False)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": cfg.created, "owned_by": "dflash-mlx",
                **({"dflash": cfg.info} if cfg.info else {})}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card(cfg.model_id)]})

    async def model(request: Request):
        name = request.path_params["name"]
        if name not in (cfg.model_id, *cfg.aliases):
            raise APIError(404, f"The model {name!r} does not exist: this server serves "
                           f"'{cfg.model_id}'", "model", "model_not_found")
        return JSONResponse(model_card(name))

    async def metrics(request: Request):
        return PlainTextResponse(render_metrics(worker, http), media_type=METRICS_TYPE)

    async def health(request: Request):
        ok = worker.alive
        body = {"status": "ok" if ok else "unavailable", "model": cfg.model_id,
                "running": worker.running, "queued": worker.queued, **worker.counts,
                "prompt_cache": worker.cache_info(), "speculation": worker.speculation()}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def http_error(request: Request, exc: HTTPException):
        msg = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed "
               f"on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, msg)

    async def server_error(request: Request, exc: Exception):
        return error_response(500, f"internal error ({type(exc).__name__})")

    routes = [
        Route("/v1/chat/completions", guarded(chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(text_completions), methods=["POST"]),
        Route("/v1/responses", guarded(responses), methods=["POST"]),
        Route("/v1/responses/{response_id}", guarded(stored_response),
              methods=["GET", "DELETE"]),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/models/{name:path}", guarded(model), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/health", guarded(health, auth=False), methods=["GET"]),
        Route("/v1/health", guarded(health, auth=False), methods=["GET"]),
    ]
    middleware = [Middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                             allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"],
                             max_age=600)] if cfg.allowed_origins else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


def _authorized(request: Request, key: str) -> bool:
    # Compared as bytes, as the client sent them (Starlette decodes headers as latin-1); the
    # key as UTF-8, so a non-ASCII key works for a client that sends it as UTF-8.
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode("latin-1"), key.encode("utf-8"))


def bind(host: str, port: int) -> socket.socket:
    """Listen before loading the model, so a taken port fails in a second."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise DFlashError(f"--port must be between 0 and 65535, got {port!r}")
    if not isinstance(host, str) or not host or "\0" in host or len(host) > 253:
        raise DFlashError(f"--host {host!r} is not a host name or address")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        gai = isinstance(e, socket.gaierror)  # a name that does not resolve: errno < 0
        why = e.strerror if gai else (os.strerror(e.errno) if e.errno else str(e))
        raise DFlashError(f"cannot listen on {host}:{port} ({why})") from None
    except (UnicodeError, ValueError, OverflowError) as e:
        raise DFlashError(f"--host {host!r} is not a host name or address ({e})") from None


def serve(worker: Worker, cfg: ServerConfig, sock: socket.socket, log_level: str = "info") -> None:
    """Run uvicorn on an already bound socket until Ctrl-C / SIGTERM."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            worker.cancel_all()  # open streams end at their next block, so shutdown is quick
            super().handle_exit(sig, frame)

        def capture_signals(self):
            if getattr(worker, "group", None) is not None:  # mlx.launch: a signal ends
                return contextlib.nullcontext()  # every rank at once (distributed.world)
            return super().capture_signals()

    worker.start()
    config = uvicorn.Config(create_app(worker, cfg), log_level=log_level,
                            timeout_graceful_shutdown=5)
    try:
        Server(config).run(sockets=[sock])
    finally:
        worker.close()
