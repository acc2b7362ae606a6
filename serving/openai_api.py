"""The OpenAI-compatible HTTP frontend (FastAPI + uvicorn, as vLLM's and Triton's own): /v1/models,
/v1/chat/completions, /v1/completions and /health, in front of the `ensemble` model of a running
tritonserver, reached over gRPC streaming with tritonclient's asyncio client.

Requests are checked here (openai_protocol) before they reach Triton; the served model checks what
needs the tokenizer (the prompt's length, the drafter's name) and its errors come back with the
status a client acts on. A client that goes away, streaming or not, cancels its gRPC stream, and
the model frees the slot at its next step. Run by `angelspec serve` (`--openai-port`), or alone:
python -m angelspec.serving.openai_api --grpc-url 127.0.0.1:8001 --model NAME."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time

import numpy as np
import tritonclient.grpc.aio as grpcclient
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from angelspec.serving.openai_protocol import (
    APIError,
    Call,
    StopCutter,
    TextEvents,
    chunk,
    completion,
    from_server,
    new_id,
    parse,
    sse,
    usage,
)

MODEL = "ensemble"  # the served model's name in Triton (tensorrtllm_backend's)
OUTPUTS = ("text_output", "num_input_tokens", "num_output_tokens", "total_accepted_draft_tokens",
           "total_draft_tokens", "drafter_used", "finish_reason")
TYPES = {str: ("BYTES", object), bool: ("BOOL", bool), int: ("INT32", np.int32), float: ("FP32", np.float32)}
log = logging.getLogger("angelspec.openai")


class Backend:
    """The ensemble in tritonserver over gRPC: one bidirectional stream a request."""

    def __init__(self, url: str, timeout_s: float = 0.0):
        self.url, self.client, self.timeout_s = url, None, timeout_s
        self.max_len = None  # the served context per request, read from the model's config

    async def connect(self):
        self.client = grpcclient.InferenceServerClient(self.url)

    async def ready(self) -> bool:
        try:
            if not (await self.client.is_server_ready() and await self.client.is_model_ready(MODEL)):
                return False
            if self.max_len is None:
                cfg = await self.client.get_model_config(MODEL, as_json=True)
                self.max_len = int(cfg["config"]["parameters"]["max_len"]["string_value"])
            return True
        except Exception:  # noqa: BLE001 - not reachable is not ready
            return False

    @staticmethod
    def tensors(inputs: dict) -> list:
        out = []
        for name, value in inputs.items():
            ttype, dtype = ("UINT64", np.uint64) if name == "seed" else TYPES[type(value)]
            t = grpcclient.InferInput(name, [1], ttype)
            t.set_data_from_numpy(np.array([value.encode() if isinstance(value, str) else value], dtype=dtype))
            out.append(t)
        return out

    async def generate(self, call: Call, stream: bool):
        """The served model's responses as dicts: text (since the last), prompt and output token
        counts, accepted and drafted tokens, drafter, finish_reason ("" until the last). The gRPC
        stream is cancelled when the caller stops early (a stop string, a client gone)."""
        request = {"model_name": MODEL, "inputs": self.tensors({**call.inputs, "stream": stream}),
                   "outputs": [grpcclient.InferRequestedOutput(n) for n in OUTPUTS]}
        if self.timeout_s:  # Triton's request timeout (us): the model ends the request with an error
            request["timeout"] = int(self.timeout_s * 1e6)

        async def one():
            yield request

        responses = self.client.stream_infer(one())
        try:
            async for result, error in responses:
                if error is not None:
                    raise from_server(error.message(), call.kind)
                f = fields(result.get_response())
                out = {"text": f["text_output"], "prompt": f["num_input_tokens"],
                       "output": f["num_output_tokens"], "accepted": f["total_accepted_draft_tokens"],
                       "drafted": f["total_draft_tokens"], "drafter": f["drafter_used"],
                       "finish_reason": f["finish_reason"]}
                yield out
                if out["finish_reason"]:
                    return
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - the connection to tritonserver itself
            log.warning("tritonserver at %s: %s", self.url, exc)
            raise APIError(503, "the inference server is not reachable or not ready; retry later",
                           None, "server_unavailable", {"Retry-After": "1"}) from None
        finally:
            responses.cancel()


def fields(response) -> dict:
    """A response's one-element outputs, read from the raw protobuf (tritonclient's as_numpy per
    output was the frontend's largest cost per streamed chunk): INT32 -> int, BYTES -> str."""
    out = {}
    for o, raw in zip(response.outputs, response.raw_output_contents):
        if o.datatype == "BYTES":  # a 4-byte length, then the bytes
            out[o.name] = raw[4:4 + int.from_bytes(raw[:4], "little")].decode("utf-8")
        elif o.datatype == "INT32":
            out[o.name] = int.from_bytes(raw[:4], "little", signed=True)
    return out


async def _until_disconnect(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _or_disconnect(request: Request, work):
    """Await `work` unless the client goes first: then it is cancelled (and with it the gRPC
    stream); None."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(request))
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, gone):
        if t not in done:
            t.cancel()
    return task.result() if task in done else None


def create_app(grpc_url: str, models: list[str], timeout_s: float = 0.0) -> FastAPI:
    backend = Backend(grpc_url, timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        await backend.connect()
        yield
        await backend.client.close()

    app = FastAPI(title="AngelSpec OpenAI-compatible API", docs_url=None, redoc_url=None, lifespan=lifespan)

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):  # unknown paths and methods, as OpenAI errors
        return error_response(APIError(e.status_code, str(e.detail), None,
                                       "not_found" if e.status_code == 404 else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):  # no tracebacks or paths to clients; the log has them
        log.exception("internal error")
        return error_response(APIError(500, "internal error in the API server", None, "server_error"))

    @app.get("/health")
    async def health():
        ok = await backend.ready()
        return JSONResponse({"status": "ok" if ok else "not ready"}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0,
                                            "owned_by": "angelspec"} for m in models]}

    async def handle(request: Request, kind: str):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if backend.max_len is None and not await backend.ready():  # once: then errors tell
            raise APIError(503, "the inference server is not ready; retry later", None,
                           "server_unavailable", {"Retry-After": "1"})
        call = parse(body, kind, models, backend.max_len)
        cid = new_id(kind)
        # a refusal (a bad value, busy) before the stream starts is an HTTP status, not an error
        # inside a 200 stream: the first response is awaited here
        result = await _or_disconnect(request, started(backend, call) if call.stream else whole(backend, call, cid))
        if result is None:  # the client went away
            return Response(status_code=499)
        if call.stream:
            return StreamingResponse(events(backend, call, cid, result), media_type="text/event-stream")
        return result

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "text")

    return app


async def started(backend: Backend, call: Call):
    """A streamed request and its first response: (generator, first)."""
    gen = backend.generate(call, stream=True)
    try:
        return gen, await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise


async def whole(backend: Backend, call: Call, cid: str) -> dict:
    """stream: false. Streamed from the model only when stop strings must be watched for."""
    cut, parts, last = StopCutter(call.stops), [], None
    gen = backend.generate(call, stream=bool(call.stops))
    try:
        async for r in gen:
            last = r
            text, stopped = cut.feed(r["text"])
            parts.append(text)
            if stopped:
                last["finish_reason"] = "stop"
                break
    finally:
        await gen.aclose()
    if last["finish_reason"] != "stop" or not call.stops:
        parts.append(cut.flush())
    return completion(call, cid, "".join(parts), last["finish_reason"] or "stop", _usage(call, last))


def _usage(call: Call, r: dict) -> dict:
    return usage(r["prompt"], r["output"], r["accepted"], r["drafted"],
                 r["drafter"] or call.drafter or "")


async def events(backend: Backend, call: Call, cid: str, started):
    """stream: true, as server-sent events; ends with [DONE]. Errors after the first response
    (a timeout, a failed engine) come as an error object in the stream, as OpenAI sends them.
    The events of one engine response go out in one write."""
    gen, r = started
    cut, text_event = StopCutter(call.stops), TextEvents(call, cid)
    out = sse(chunk(call, cid, first=True)) if call.kind == "chat" else ""
    try:
        while True:
            text, stopped = cut.feed(r["text"])
            if stopped or r["finish_reason"]:
                text += "" if stopped else cut.flush()
                out += (text_event(text) if text else "") + sse(chunk(
                    call, cid, finish_reason="stop" if stopped else r["finish_reason"]))
                break
            if text:
                yield out + text_event(text)
                out = ""
            r = await gen.__anext__()
        if call.include_usage:
            out += sse(chunk(call, cid, use=_usage(call, r)))
    except APIError as e:
        out += sse(e.body())
    finally:
        await gen.aclose()
    yield out + "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="tritonserver's gRPC address")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback: this machine only)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--model", action="append", required=True,
                   help="the name(s) clients pass as `model` (repeatable)")
    p.add_argument("--timeout", type=float, default=0.0,
                   help="seconds a request may run before it ends with 504 (0: the server's own limit)")
    args = p.parse_args(argv)
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t0 = time.time()
    uvicorn.run(create_app(args.grpc_url, args.model, args.timeout), host=args.host, port=args.port,
                log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    log.info("stopped after %.0f s", time.time() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
