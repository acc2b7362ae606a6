"""The served model (decoupled Python), under the name tensorrtllm_backend clients call,
`ensemble`, with its tensor names: text in; the engine's tokens streamed back as text, with
acceptance statistics. Requests that arrive while a step runs join the next step (continuous
batching); every step's tokens stream out as they are committed, cut only at character
boundaries.

Why one model and not a platform ensemble (preprocessing -> engine -> postprocessing): Triton 2.51
tells a top-level request that its client went away (a cancelled gRPC stream, a closed HTTP
connection, on `generate` and `generate_stream` alike: `is_cancelled()` turns true) but does not
pass that on to the models inside an ensemble, so the engine kept decoding for nobody (measured:
none of the three transports reached it). Here the engine sees its own requests' cancellation and
frees the slot at its next step. The text stages are the functions of angelspec.text, the same
the CLI and the Python API use.

One worker thread owns the engine, from loading it on. `execute` only validates and queues.
A second thread sends the responses, in the order the worker posts them: a send is a round trip
to the server process, and the worker steps on meanwhile instead of waiting for eight of them
after every step.
More requests than max_batch_size + max_queue get "busy, retry later" (UNAVAILABLE: HTTP 503,
gRPC UNAVAILABLE) instead of an unbounded queue; a request past its timeout (request_timeout_s, or
the client's own request timeout if shorter) is ended with an error and its slot freed. A request
whose drafter fails ends with that error alone; the others go on.
"""
import json
import pathlib
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from angelspec.runtime import Request, SamplingParams, load_engine
from angelspec.text import decode_whole, encode_chat, encode_messages, encode_stop_words

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# the inputs of config.pbtxt: Triton's HTTP generate endpoint turns any other JSON field into a
# request parameter, which is refused by name
FIELDS = {"text_input", "messages", "apply_chat_template", "max_tokens", "stream", "temperature",
          "top_p", "top_k", "seed", "end_id", "ignore_eos", "stop_words", "drafter"}


def _error(message, code="INVALID_ARG"):
    """An error response; `code` names a TritonError code (pb_utils has no TritonError while
    Triton first imports this file)."""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(
        message, getattr(pb_utils.TritonError, code)))


def _strings(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    out = []
    for v in t.as_numpy().reshape(-1):
        try:
            out.append(v.decode("utf-8") if isinstance(v, bytes) else str(v))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    return out


def _scalar(request, name, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    a = t.as_numpy().reshape(-1)
    if a.size != 1:
        raise ValueError(f"{name} must hold exactly one value, got {a.size}")
    v = a[0]
    if isinstance(v, bytes):
        return _strings(request, name)[0]
    return v.item()


class Job:
    """One request in flight: its sender, streaming mode, deadline, and what is not sent yet."""

    def __init__(self, sender, stream, deadline, limit, prompt_tokens, drafter):
        self.sender, self.stream, self.deadline, self.limit = sender, stream, deadline, limit
        self.prompt_tokens, self.drafter = prompt_tokens, drafter  # drafter: the one asked for
        self.held: list[int] = []  # committed tokens not sent yet (end inside a character)
        self.tokens: list[int] = []


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        p = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        self.max_batch = int(p["max_batch_size"])
        self.capacity = self.max_batch + int(p["max_queue"])
        self.timeout = float(p["request_timeout_s"])
        # the engine's path: in a file beside this one, not in the config clients can read
        self.engine_dir = json.loads((pathlib.Path(__file__).parent / "private.json").read_text())["engine_dir"]
        dcut = {"on": True, "off": False}.get(p.get("dcut", ""))  # else: the engine's default
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()  # (sender, response or its values, flags)
        self.jobs: dict[int, Job] = {}
        self.lock = threading.Lock()
        self.next_id = 0
        self.running = True
        self.metrics()
        # The worker thread does ALL the torch work, loading and warm-up included. Every thread
        # that runs an OpenMP parallel region keeps its own pool of threads, and once the pools
        # hold more threads than there are cores, libgomp cuts the spin-wait between parallel
        # regions to almost nothing: every small op then pays a futex wake-up (the step ran
        # slower here than in-process when the engine was loaded on the main thread).
        ready, failed = threading.Event(), []

        def start():
            try:
                self.engine = load_engine(self.engine_dir, max_batch=self.max_batch,
                                          max_len=int(p["max_len"]), dcut=dcut)
                self.engine.warm_up()  # ready means ready: the first request pays no first-use costs
            except BaseException as exc:  # noqa: BLE001 - re-raised by initialize
                failed.append(exc)
                return
            finally:
                ready.set()
            self.loop()

        self.worker = threading.Thread(target=start, daemon=True)
        self.sending = threading.Thread(target=self.send_loop, daemon=True)
        self.sending.start()
        self.worker.start()
        ready.wait()
        if failed:
            raise failed[0]
        self.tok = self.engine.target.tokenizer

    def metrics(self):
        C, G = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        self.m_drafted = pb_utils.MetricFamily("angelspec_draft_tokens_total",
                                               "draft tokens verified, per drafter", C)
        self.m_accepted = pb_utils.MetricFamily("angelspec_accepted_tokens_total",
                                                "draft tokens accepted, per drafter", C)
        self.m_steps = pb_utils.MetricFamily("angelspec_steps_total", "speculative steps run", C)
        self.m_latency = pb_utils.MetricFamily("angelspec_step_seconds",
                                               "latency of the last engine step", G)
        self.m_time = pb_utils.MetricFamily("angelspec_step_seconds_total",
                                            "time spent in engine steps", C)
        self.m_active = pb_utils.MetricFamily("angelspec_requests_in_flight",
                                              "requests admitted and not finished", G)
        self.steps = self.m_steps.Metric(labels={})
        self.latency = self.m_latency.Metric(labels={})
        self.step_time = self.m_time.Metric(labels={})
        self.active = self.m_active.Metric(labels={})
        self.per_drafter = {}  # at most the engine's drafter instances (a bounded set)

    def drafter_metrics(self, name):
        if name not in self.per_drafter:
            self.per_drafter[name] = (self.m_drafted.Metric(labels={"drafter": name}),
                                      self.m_accepted.Metric(labels={"drafter": name}))
        return self.per_drafter[name]

    # -- requests -----------------------------------------------------------------------------
    def parse(self, request):
        """A request's fields -> (Request, stream). Text fields are checked here; every other
        value by the engine's own checks when it is admitted (the ones the CLI and the Python
        API meet)."""
        unknown = sorted(set(json.loads(request.parameters() or "{}")) - FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)[:200]}; the fields are "
                             + ", ".join(sorted(FIELDS)))
        text, messages = _scalar(request, "text_input", None), _scalar(request, "messages", None)
        if (text is None) == (messages is None):
            raise ValueError("give text_input (a prompt) or messages (a JSON list of chat turns), "
                             "one of them")
        if messages is not None:  # a conversation: always through the chat template
            try:
                messages = json.loads(messages)
            except ValueError:
                raise ValueError("messages is not JSON: a list of {role, content} turns") from None
            ids = encode_messages(self.tok, messages)
        elif not text.strip():
            raise ValueError("text_input is empty: give some text to respond to")
        else:
            ids = encode_chat(self.tok, text, chat=bool(_scalar(request, "apply_chat_template", True)))
        room = self.engine.max_len - len(ids)
        max_tokens = _scalar(request, "max_tokens", None)
        if max_tokens is None:  # as vLLM and the OpenAI API: the room left in the context
            max_tokens = max(room, 1)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
        if max_tokens > room > 0:
            raise ValueError(f"max_tokens {max_tokens} exceeds the room left in the context: "
                             f"{len(ids)} prompt tokens of {self.engine.max_len}, at most {room}")
        stop_ids = encode_stop_words(self.tok, _strings(request, "stop_words") or [])
        end_id = _scalar(request, "end_id", None)
        if end_id is not None:
            stop_ids.append(int(end_id))
        seed = _scalar(request, "seed", None)
        params = SamplingParams(
            max_tokens=int(max_tokens), temperature=float(_scalar(request, "temperature", 0.0)),
            top_p=float(_scalar(request, "top_p", 1.0)), top_k=int(_scalar(request, "top_k", 0)),
            seed=None if seed is None else int(seed), stop_token_ids=stop_ids,
            ignore_eos=bool(_scalar(request, "ignore_eos", False)))
        drafter = _scalar(request, "drafter", "") or self.engine.default_drafter
        return Request(ids, params, drafter), bool(_scalar(request, "stream", False))

    def clean(self, message) -> str:
        """An error for a client: no server paths in it."""
        return str(message).replace(self.engine_dir, "<engine>")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req, stream = self.parse(request)
            except Exception as exc:  # noqa: BLE001 - one bad request gets its own error
                sender.send(_error(self.clean(exc)), flags=FINAL)
                continue
            with self.lock:
                if len(self.jobs) + self.inbox.qsize() >= self.capacity:
                    sender.send(_error(f"busy: {self.capacity} requests in flight, retry later",
                                       "UNAVAILABLE"), flags=FINAL)
                    continue
                self.next_id += 1
                rid = self.next_id
            asked = request.timeout() / 1e6  # the client's request timeout (us); 0 = none
            limit = min(self.timeout, asked) if asked > 0 else self.timeout
            job = Job(sender, stream, time.time() + limit, limit, len(req.prompt_ids), req.drafter)
            self.inbox.put((rid, req, job))
        return None

    # -- the worker -----------------------------------------------------------------------------
    def loop(self):
        while self.running:
            self.admit(block=not self.engine.busy)
            self.expire()
            self.active.set(len(self.jobs))
            if not self.engine.busy:
                continue
            t0 = time.perf_counter()
            try:
                events = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - never leave clients hanging
                # a drafter's failure ends its own requests inside the step; what reaches here
                # broke the shared forward, so every request in it fails
                for rid in list(self.jobs):
                    self.fail(rid, f"engine error: {type(exc).__name__}: {exc}", "INTERNAL")
                continue
            dt = time.perf_counter() - t0
            self.latency.set(dt)
            self.step_time.increment(dt)
            self.steps.increment(1)
            for ev in events:
                self.deliver(ev)

    def admit(self, block):
        try:
            item = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            rid, req, job = item
            try:
                self.engine.submit(req, rid)
                self.jobs[rid] = job
            except Exception as exc:  # noqa: BLE001 - one bad request gets its own error
                job.sender.send(_error(self.clean(exc)), flags=FINAL)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                item = None

    def expire(self):
        """End requests whose client went away or whose deadline passed. Every open request is
        asked before every step, so a slot is free at most one step after Triton learns of the
        cancellation. Each question is a round trip to the server process; asking every step
        cost no throughput against asking on a timer (docs/serving.md)."""
        now = time.time()
        for rid, job in list(self.jobs.items()):
            if job.sender.is_cancelled():
                self.engine.cancel(rid)
                del self.jobs[rid]
                self.outbox.put((job.sender, None, FINAL))  # complete: Triton can release it
            elif now > job.deadline:
                self.fail(rid, f"request timed out after {job.limit:g} s", "UNAVAILABLE")

    def fail(self, rid, message, code="INVALID_ARG"):
        self.engine.cancel(rid)
        job = self.jobs.pop(rid, None)
        if job is not None:
            self.outbox.put((job.sender, _error(self.clean(message), code), FINAL))

    def post(self, text, job, stats, drafter, finish_reason=""):
        """Queue one response for the sender thread, its values read now: the text since the
        last one (or all of it, not streaming), the drafts' counts so far, the prompt's and the
        generated tokens so far, the drafter (the one asked for until the final response names
        the one used), finish_reason (stop, length) in the final one, which ends the request."""
        values = (job.prompt_tokens, len(job.tokens), finish_reason, text,
                  stats.accepted if stats else 0, stats.drafted if stats else 0, drafter or "")
        self.outbox.put((job.sender, values, FINAL if finish_reason else 0))

    def send_loop(self):
        """The sender thread: every posted response, in order, until finalize posts None."""
        while (item := self.outbox.get()) is not None:
            sender, response, flags = item
            try:
                sender.send(self.response(*response) if isinstance(response, tuple) else response,
                            flags=flags)
            except Exception as exc:  # noqa: BLE001 - one request's failed send; the others go on
                pb_utils.Logger.log_warn(f"a response could not be sent: {exc}")

    @staticmethod
    def response(prompt_tokens, output_tokens, finish_reason, text, accepted, drafted, drafter):
        i32 = lambda v: np.array([v], dtype=np.int32)  # noqa: E731
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("num_input_tokens", i32(prompt_tokens)),
            pb_utils.Tensor("num_output_tokens", i32(output_tokens)),
            pb_utils.Tensor("finish_reason", np.array([finish_reason.encode()], dtype=object)),
            pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object)),
            pb_utils.Tensor("acceptance_rate", np.array([accepted / drafted if drafted else 0.0], dtype=np.float32)),
            pb_utils.Tensor("total_accepted_draft_tokens", np.array([accepted], dtype=np.int32)),
            pb_utils.Tensor("total_draft_tokens", np.array([drafted], dtype=np.int32)),
            pb_utils.Tensor("drafter_used", np.array([drafter.encode()], dtype=object))])

    def deliver(self, ev):
        job = self.jobs.get(ev.index)
        if job is None:
            return
        job.tokens += ev.tokens
        if ev.finish_reason == "error":  # this request's drafter failed; the others went on
            return self.fail(ev.index, ev.error, "INTERNAL")
        if ev.finish_reason:
            del self.jobs[ev.index]
            d, a = self.drafter_metrics(ev.drafter)
            d.increment(ev.stats.drafted)
            a.increment(ev.stats.accepted)
            ids = job.held + ev.tokens if job.stream else job.tokens
            text = self.tok.decode(ids, skip_special_tokens=True)
            self.post(text, job, ev.stats, ev.drafter, ev.finish_reason)
            return
        if not job.stream or not ev.tokens:
            return
        job.held += ev.tokens
        # the held tokens start where a character starts, so decoding them alone tells whether
        # they end inside one
        text = decode_whole(self.tok, job.held)
        if text is None:
            return
        job.held = []
        self.post(text, job, ev.stats, job.drafter)

    def finalize(self):
        """Shutting down: stop the worker, then end every request still open with an error, so
        Triton is not left waiting for final responses (and the server stops promptly)."""
        self.running = False
        self.worker.join(timeout=5)
        for rid in list(self.jobs):
            self.fail(rid, "the server is shutting down", "UNAVAILABLE")
        self.outbox.put(None)
        self.sending.join(timeout=5)
        while not self.inbox.empty():
            _, _, job = self.inbox.get_nowait()
            job.sender.send(_error("the server is shutting down", "UNAVAILABLE"), flags=FINAL)
