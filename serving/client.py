"""`angelspec client`: one request to the served ensemble, printing the text and the acceptance
statistics. The ensemble is decoupled (it streams), so: HTTP goes to Triton's generate endpoint,
gRPC through tritonclient's streaming RPC (without --stream the server sends one response)."""
from __future__ import annotations

import queue
import sys

import numpy as np


def inputs(module, prompt: str, max_tokens: int, stream: bool, drafter: str | None,
           temperature: float, seed: int | None) -> list:
    """The ensemble's input tensors (tensorrtllm_backend names)."""
    def tensor(name, value, dtype, triton_type):
        t = module.InferInput(name, [1], triton_type)
        t.set_data_from_numpy(np.array([value], dtype=dtype))
        return t
    out = [tensor("text_input", prompt.encode("utf-8"), object, "BYTES"),
           tensor("max_tokens", max_tokens, np.int32, "INT32"),
           tensor("stream", stream, bool, "BOOL"),
           tensor("temperature", temperature, np.float32, "FP32")]
    if drafter:
        out.append(tensor("drafter", drafter.encode(), object, "BYTES"))
    if seed is not None:
        out.append(tensor("seed", seed, np.uint64, "UINT64"))
    return out


OUTPUTS = ("text_output", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens",
           "drafter_used")


def stats_line(result) -> str:
    get = lambda n: result.as_numpy(n).reshape(-1)[0]  # noqa: E731
    used = get("drafter_used")
    return (f"drafter {used.decode() if isinstance(used, bytes) else used}, accepted "
            f"{get('total_accepted_draft_tokens')} of {get('total_draft_tokens')} draft tokens "
            f"(acceptance rate {get('acceptance_rate'):.2f})")


def http_generate(url: str, args) -> int:
    """HTTP: Triton's generate endpoint (its infer endpoint does not serve decoupled models)."""
    import json
    import urllib.error
    import urllib.request

    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.drafter:
        body["drafter"] = args.drafter
    if args.seed is not None:
        body["seed"] = args.seed
    req = urllib.request.Request(f"http://{url}/v2/models/ensemble/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(json.loads(e.read() or b"{}").get("error", str(e))) from None
    print(out["text_output"])
    print(f"drafter {out['drafter_used']}, accepted {out['total_accepted_draft_tokens']} of "
          f"{out['total_draft_tokens']} draft tokens (acceptance rate {out['acceptance_rate']:.2f})",
          file=sys.stderr)
    return 0


def run(args) -> int:
    import tritonclient.grpc as client
    url = args.url or ("127.0.0.1:8001" if args.grpc or args.stream else "127.0.0.1:8000")
    if not args.stream and not args.grpc:
        return http_generate(url, args)
    ins = inputs(client, args.prompt, args.max_tokens, args.stream, args.drafter,
                 args.temperature, args.seed)
    outs = [client.InferRequestedOutput(n) for n in OUTPUTS]
    results: queue.Queue = queue.Queue()
    c = client.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    c.async_stream_infer("ensemble", ins, outputs=outs, enable_empty_final_response=True)
    last = None
    while True:
        result, error = results.get()
        if error is not None:
            c.stop_stream()
            raise RuntimeError(str(error))
        final = result.get_response().parameters.get("triton_final_response")
        if result.as_numpy("text_output") is not None:
            sys.stdout.write(result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"))
            sys.stdout.flush()
            last = result
        if final is not None and final.bool_param:
            break
    c.stop_stream()
    print()
    if last is not None:
        print(stats_line(last), file=sys.stderr)
    return 0
