"""The OpenAI API's request and response shapes, for the frontend in openai_api.py: a request body
checked field by field (the sampling values by the engine's own rules, angelspec.params) and turned
into the served model's inputs; errors as OpenAI error objects naming their field; the completion
objects and stream chunks; stop strings cut from the text. Pure functions: no I/O here."""
from __future__ import annotations

import dataclasses
import json
import time
import uuid

from angelspec.params import SamplingParams

MAX_STOPS, MAX_STOP_CHARS = 16, 256
# OpenAI fields accepted at their neutral value only (what clients send by default); other
# values are refused by name, not silently ignored
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "echo": False,
           "best_of": 1, "logit_bias": {}, "parallel_tool_calls": None, "tools": [], "tool_choice": "none",
           "response_format": {"type": "text"}, "suffix": None, "top_logprobs": 0}
IGNORED = {"user", "metadata", "store", "service_tier"}  # bookkeeping fields with no effect here
SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "ignore_eos", "drafter"}
FIELDS = {"chat": SHARED | {"messages", "max_completion_tokens"}, "text": SHARED | {"prompt"}}


class APIError(Exception):
    """An error for the client: HTTP status, message, the field it concerns, OpenAI's type."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers, self.code = headers or {}, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass
class Call:
    """One checked request: what goes to the served model, and what the frontend does itself."""
    kind: str  # "chat" or "text"
    model: str
    inputs: dict  # the served model's input name -> value
    stream: bool
    include_usage: bool
    stops: list[str]
    drafter: str | None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _content(i: int, content) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's multi-part form)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts "
                        "(this model reads text only)", f"messages[{i}].content")


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = {"developer": "system"}.get(m.get("role"), m.get("role"))  # OpenAI's newer name
        if role not in ("system", "user", "assistant"):
            raise APIError(400, f"messages[{i}].role must be system, developer, user or assistant, "
                                f"got {str(m.get('role'))[:40]!r}", f"messages[{i}].role")
        out.append({"role": role, "content": _content(i, m.get("content"))})
    if not any(m["content"].strip() for m in out):
        raise APIError(400, "messages hold no text: give some text to respond to", "messages")
    return out


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise APIError(400, "prompt must be one string (lists of prompts and token ids are not "
                            "supported)", "prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise APIError(400, "prompt must be a non-empty string", "prompt")
    return prompt


def _stops(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} "
                            "characters", "stop")
    return [s for s in stops if s]


def parse(body, kind: str, models: list[str], max_len: int) -> Call:
    """A request body -> Call, or APIError (400 naming the field, 404 for an unknown model).
    `max_len`: the served context of a request (prompt + output tokens)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in sorted(set(body) - FIELDS[kind] - IGNORED):
        if name not in NEUTRAL:
            raise APIError(400, f"unrecognized field {name[:60]!r}", name[:60])
        if body[name] not in (NEUTRAL[name], None):
            raise APIError(400, f"{name} is not supported: leave it out or at "
                                f"{json.dumps(NEUTRAL[name])}", name)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "model is required: one of " + ", ".join(models), "model")
    if model not in models:
        raise APIError(404, f"the model {model[:80]!r} does not exist; this server has "
                            + ", ".join(models), "model", code="model_not_found")
    n = body.get("n", 1)
    if n != 1 or not _is_int(n):
        raise APIError(400, f"n must be 1 (one choice per request), got {json.dumps(n)[:40]}", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise APIError(400, "stream_options is an object ({\"include_usage\": true|false}) and only "
                            "for stream: true", "stream_options")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(400, "ignore_eos must be true or false", "ignore_eos")
    drafter = body.get("drafter")
    if drafter is not None and (not isinstance(drafter, str) or not drafter):
        raise APIError(400, "drafter must be a drafter's name (auto, mtp, dfly, dflash, ngram, none)",
                       "drafter")

    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(field)
    top_k = body.get("top_k", 0)
    params = SamplingParams(max_tokens=1 if max_tokens is None else max_tokens,
                            temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                            top_k=0 if top_k == -1 else top_k, seed=body.get("seed"))  # -1: vLLM's "off"
    try:
        params.validate()
    except ValueError as exc:
        name = str(exc).split()[0]
        raise APIError(400, str(exc).replace("max_tokens", field, 1) if name == "max_tokens" else str(exc),
                       field if name == "max_tokens" else name) from None
    if max_tokens is not None and max_tokens >= max_len:
        raise APIError(400, f"{field} {max_tokens} exceeds the context of {max_len} tokens (prompt + "
                            "output)", field)

    inputs = {"temperature": float(params.temperature), "top_p": float(params.top_p),
              "top_k": params.top_k, "ignore_eos": ignore_eos}
    if max_tokens is not None:  # else: the room left in the context
        inputs["max_tokens"] = max_tokens
    if params.seed is not None:
        inputs["seed"] = params.seed
    if drafter:
        inputs["drafter"] = drafter
    if kind == "chat":
        inputs["messages"] = json.dumps(_messages(body.get("messages")))
    else:
        inputs["text_input"], inputs["apply_chat_template"] = _prompt(body.get("prompt")), False
    return Call(kind, model, inputs, stream, bool((options or {}).get("include_usage")),
                _stops(body.get("stop")), drafter)


def from_server(message: str, kind: str = "chat") -> APIError:
    """The served model's error message -> the HTTP status a client acts on: busy 429 (retry),
    timed out 504, shutting down or not loaded 503, the engine's own failure 500, anything else
    the request's fault: 400, naming the field the message starts with (or its drafter)."""
    message = message.strip()
    if message.startswith("busy"):
        return APIError(429, message, None, "rate_limit_exceeded", {"Retry-After": "1"})
    if "timed out" in message:
        return APIError(504, message, None, "timeout")
    if "shutting down" in message or "unknown model" in message or "is not ready" in message:
        return APIError(503, message, None, "server_unavailable", {"Retry-After": "1"})
    if message.startswith("engine error") or (message.startswith("drafter ") and " failed: " in message):
        return APIError(500, message, None, "server_error")
    words = message.replace(":", " ").split()[:2]
    first = words[0] if words else ""
    prompt = "messages" if kind == "chat" else "prompt"
    param = ({"text_input": prompt, "prompt": prompt, "messages": "messages"}.get(first)
             or (first if first in SHARED else None) or ("drafter" if "drafter" in words else None))
    return APIError(400, message, param)


class StopCutter:
    """Cuts streamed text at the first stop string: `feed` returns the text safe to show (it holds
    back a tail that could be the start of a stop string) and whether a stop string was met."""

    def __init__(self, stops: list[str]):
        self.stops, self.hold = stops, max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        self.buf += text
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf = self.buf[:cut], ""
            return out, True
        keep = len(self.buf) - self.hold
        out, self.buf = (self.buf[:keep], self.buf[keep:]) if keep > 0 else ("", self.buf)
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, accepted: int, drafted: int, drafter: str) -> dict:
    """OpenAI's usage, with the speculation's counts in completion_tokens_details and the drafter
    used (an extension field)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted},
            "drafter": drafter}


def completion(call: Call, cid: str, text: str, finish_reason: str, use: dict) -> dict:
    """The whole answer (stream: false)."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if call.kind == "chat"
              else {"index": 0, "text": text})
    choice.update(finish_reason=finish_reason, logprobs=None)
    return {"id": cid, "object": "chat.completion" if call.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": call.model, "choices": [choice], "usage": use}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class TextEvents:
    """The stream's text events, preformatted around the text (the hot path: one per chunk the
    engine streams); equal to sse(chunk(call, cid, text))."""

    def __init__(self, call: Call, cid: str):
        whole = sse(chunk(call, cid, "\x00"))
        self.head, self.tail = whole.split(json.dumps("\x00"))

    def __call__(self, text: str) -> str:
        return self.head + json.dumps(text) + self.tail


def chunk(call: Call, cid: str, text: str | None = None, finish_reason: str | None = None,
          use: dict | None = None, first: bool = False) -> dict:
    """One stream chunk: text, or the finish reason, or (choices empty) the usage."""
    if use is not None:
        choices = []
    elif call.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    out = {"id": cid, "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
           "created": int(time.time()), "model": call.model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
