"""A chat template rendered once at load with a time and a size bound.

A template is a program: one that loops for ever, or writes gigabytes, would hang or exhaust
the machine the first time a prompt is rendered. Rendering one short conversation when the
target loads finds those templates first and refuses them with one line. A template that
raises on this conversation is left alone here: rendering a real prompt reports that error.

The probe runs in a thread of its own: a Python loop inside Jinja cannot be interrupted from
outside, so a template that overruns has an exception raised inside that thread, which stops
it at its next bytecode.
"""

from __future__ import annotations

import ctypes
import threading
import time

from .errors import ConfigError

SECONDS = 5.0  # real templates render a short chat in milliseconds
MAX_CHARS = 1 << 20  # ... into a few hundred characters
PROBE = [{"role": "system", "content": "You are helpful."},
         {"role": "user", "content": "Hello."},
         {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "How are you?"}]


class _Overrun(BaseException):
    """Raised inside the probe's thread to stop a template that ran past its bound."""


def check_template(tokenizer, where: str, seconds: float | None = None,
                   max_chars: int | None = None) -> None:
    """Refuse `tokenizer`'s chat template when rendering a short chat does not end within
    `seconds`, or writes more than `max_chars` characters (`where` names it)."""
    seconds = SECONDS if seconds is None else seconds
    max_chars = MAX_CHARS if max_chars is None else max_chars
    source = getattr(tokenizer, "chat_template", None)
    if not isinstance(source, str):  # none, or a list of named ones transformers picks from
        return
    template = _compile(source)
    if template is None:
        return  # does not parse: reported when a prompt is rendered
    specials = _special_strings(tokenizer)
    outcome: dict = {}

    def render():
        try:
            size = 0
            for chunk in template.generate(messages=PROBE, add_generation_prompt=True,
                                           **specials):
                size += len(chunk)
                if size > max_chars:
                    outcome["size"] = size
                    return
        except _Overrun:
            return
        except BaseException as e:  # noqa: BLE001 - a template's own errors show on use
            outcome["error"] = e

    worker = threading.Thread(target=render, name="template-probe", daemon=True)
    start = time.perf_counter()
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        _interrupt(worker)
        raise ConfigError(f"{where}: the chat template did not finish rendering a four-message "
                          f"chat in {seconds:g} s (a template that never ends?)")
    if "size" in outcome:
        raise ConfigError(f"{where}: the chat template wrote over {max_chars} characters for a "
                          "four-message chat (the limit)")
    if isinstance(outcome.get("error"), MemoryError):
        raise ConfigError(f"{where}: the chat template ran out of memory rendering a "
                          f"four-message chat (after {time.perf_counter() - start:.1f} s)")


def _compile(source: str):
    """The template compiled as transformers compiles it (its sandbox, filters and tags);
    None when it does not parse."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_
    except ImportError:  # another transformers: the plain Jinja sandbox
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        compile_ = ImmutableSandboxedEnvironment().from_string
    try:
        return compile_(source)
    except Exception:  # noqa: BLE001 - a syntax error: rendering a prompt reports it
        return None


def _special_strings(tokenizer) -> dict:
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    specials = getattr(hf, "special_tokens_map", None) or {}
    return {k: v for k, v in specials.items() if isinstance(v, str)}


def _interrupt(thread: threading.Thread) -> None:
    """Stop `thread` at its next bytecode (CPython); it is a daemon, so at worst it ends with
    the process."""
    set_exc = getattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", None)
    if set_exc is None or thread.ident is None:
        return
    set_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Overrun))
    thread.join(1.0)
