"""bench's result rows, one per runner and domain (result_rows), and the table `angelspec bench`
prints from a result (format_table)."""
from __future__ import annotations

import statistics

from angelspec.bench.compare import agreement, compare, paired
from angelspec.bench.peers import SPECULATING
from angelspec.bench.references import OTHER_NUMERICS, REFERENCES
from angelspec.bench.runs import Run
from angelspec.checkpoint import Target


def result_rows(runs: list[Run], prompts: list[dict], ids: list[list[int]], ref: list[list[int]],
                target: Target, eps: float, concurrency: int, rounds: int, weight_bytes: int) -> list[dict]:
    """A row per runner and domain, and one over all domains: speed (each runner's against
    `runs[0]`, ar's), accept counts, and whether its output is `ref`'s, the batch-1 ar output
    (compare: a divergence at a near-tie below `eps` is counted apart)."""
    domains = list(dict.fromkeys(p["domain"] for p in prompts))
    ar_tps = {}  # per domain: ar runs first, and every runner's speedup is against it
    rows = []
    for run in runs:
        verdicts = [compare(target, ids[i], ref[i], run.outputs[i], eps)
                    for i in range(len(prompts))]
        for dom in domains + ["all"]:
            idx = [i for i, p in enumerate(prompts) if dom in ("all", p["domain"])]
            row = _counts(run, dom, idx, verdicts, concurrency)
            if run.drafter in OTHER_NUMERICS:  # how far its greedy text follows ours
                row.update(_followed(run, runs, dom, idx, ref))
            if dom == "all" or dom in run.seconds:  # mixed batches: time only for "all"
                row.update(_speed(run, dom, row["new_tokens"], ar_tps, concurrency, rounds, weight_bytes))
            if dom == "all" and run is not runs[0]:  # each batch against ar's, back to back
                row["paired_vs_ar"] = paired(run.rates, runs[0].rates)
            if dom == "all" and run.drafter not in REFERENCES:
                # drafting time per step against the verification forward's (the same steps)
                row["draft_per_forward"] = round(run.draft_time / run.forward_time, 3) \
                    if run.forward_time else None
            if run.drafter == "auto":
                used = [run.used[i] for i in idx]
                row["drafter_used"] = {d: used.count(d) for d in sorted(set(used))}
            rows.append(row)
    return rows


def _counts(run: Run, dom: str, idx: list[int], verdicts: list[str], concurrency: int) -> dict:
    """A row's tokens, accept counts and lossless verdict; its times are filled in by _speed."""
    new = sum(len(run.outputs[i]) for i in idx)  # per round
    steps = sum(run.steps[i] for i in idx)
    return {"drafter": run.drafter, "dcut": run.dcut, "concurrency": concurrency,
            "domain": dom, "n_prompts": len(idx), "new_tokens": new,
            "seconds": None, "tokens_per_s": None,
            "mean_accept_len": None if run.drafter in REFERENCES else
            round(sum(run.committed[i] for i in idx) / max(steps, 1), 3),
            "verified_per_step": None if run.drafter in REFERENCES else
            round(sum(run.drafted[i] for i in idx) / max(steps, 1), 2),
            # of the steps that verified a draft token, the share that accepted the first
            "first_accept": None if run.drafter in REFERENCES or not sum(run.tried[i] for i in idx)
            else round(sum(run.first[i] for i in idx) / sum(run.tried[i] for i in idx), 3),
            "speedup_vs_ar": None,
            "lossless": all(verdicts[i] != "diverged" for i in idx),
            "near_ties": sum(verdicts[i] == "near_tie" for i in idx),
            "weight_gb_per_s": None}


def _followed(run: Run, runs: list[Run], dom: str, idx: list[int], ref: list[list[int]]) -> dict:
    """A runner of other numerics (OTHER_NUMERICS): how far its greedy text follows ar's, a
    peer's speculation against the same peer's greedy output, and a peer's own decode rate."""
    out = dict(lossless=None, near_ties=0,
               same_as_ar=sum(run.outputs[i] == ref[i] for i in idx),
               token_agreement=round(statistics.mean(agreement(ref[i], run.outputs[i])
                                                     for i in idx), 3))
    own = next((r for r in runs if r.drafter == SPECULATING.get(run.drafter)), None)
    if own:  # a peer's speculation against its own greedy output
        out["same_as_own_greedy"] = sum(run.outputs[i] == own.outputs[i] for i in idx)
    dec = [run.decoded[d] for d in run.decoded if dom in ("all", d)]
    if dec and sum(s for _, s in dec):
        out["decode_tokens_per_s"] = round(sum(n for n, _ in dec) / sum(s for _, s in dec), 2)
    return out


def _speed(run: Run, dom: str, new: int, ar_tps: dict, concurrency: int, rounds: int,
           weight_bytes: int) -> dict:
    """A timed row's seconds, tokens/s (with many in flight: while every slot was busy, the
    whole run's beside it), speedup over ar's (kept in `ar_tps` when `run` is ar's) and the
    weights' read rate."""
    pick = (lambda m: sum(m.values())) if dom == "all" else (lambda m: m[dom])  # noqa: E731
    secs, pre, forwards = pick(run.seconds), pick(run.prefill), pick(run.forwards)
    out = {}
    tps = new * rounds / secs
    if concurrency > 1 and run.steady_seconds:  # the load asked for, not the drain
        out.update(drained_tokens_per_s=round(tps, 2), busy_tokens=run.steady_tokens,
                   busy_seconds=round(run.steady_seconds, 6))
        tps = run.steady_tokens / run.steady_seconds
    if run.drafter == "ar":
        ar_tps[dom] = tps
    # weights read per second while decoding: one read per verification forward
    # (hf: one per token, prefill included as it cannot be separated)
    out.update(seconds=round(secs, 3), tokens_per_s=round(tps, 2),
               speedup_vs_ar=round(tps / ar_tps[dom], 3),
               weight_gb_per_s=None if run.drafter in OTHER_NUMERICS else  # their own bytes
               round(forwards * weight_bytes / (secs - pre) / 1e9, 2))
    return out


def format_table(result: dict) -> str:
    cfg = result["config"]
    synthetic = " (synthetic: random weights, speed only)" if cfg.get("synthetic") else ""
    lines = [f"target {cfg['target']}{synthetic}  |  {cfg['prompts']} prompts, {cfg['max_tokens']} new "
             f"tokens{' (EOS ignored)' if cfg.get('ignore_eos') else ''}, {cfg['concurrency']} in flight, "
             f"{'greedy' if cfg['greedy'] else 'sampled at T=%g top_p=%g' % (cfg['temperature'], cfg['top_p'])}, "
             f"{cfg['threads']} threads, D-cut {cfg.get('dcut', 'off')}  |  "
             f"weights {cfg['weight_mb']} MB {cfg.get('weights', 'float32')}"
             f"{'' if cfg.get('resident_mb') is None else ' (engine process resident: %g MB)' % cfg['resident_mb']}"
             f"{'' if cfg.get('huge_page_mb') is None else ' (%g MB on huge pages)' % cfg['huge_page_mb']}, "
             f"machine streams {cfg['stream_bandwidth_gb_per_s']} GB/s",
             f"{'drafter':<22} {'domain':<6} {'tok/s':>8} {'accept':>7} {'acc1':>5} {'verify':>6} {'speedup':>8} "
             f"{'GB/s':>6} {'%bw':>5} {'lossless':>9} {'near_ties':>9} {'draft/fwd':>9}  used"]
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in result["results"]:
        pct = None if r["weight_gb_per_s"] is None else \
            100 * r["weight_gb_per_s"] / cfg["stream_bandwidth_gb_per_s"]
        name = r["drafter"] + ("+dcut" if r.get("dcut") else "")
        used = " ".join(f"{d}:{n}" for d, n in r.get("drafter_used", {}).items())
        lines.append(f"{name:<22} {r['domain']:<6} {num(r['tokens_per_s'], '8.2f'):>8} "
                     f"{num(r['mean_accept_len'], '.2f'):>7} {num(r.get('first_accept'), '.2f'):>5} "
                     f"{num(r.get('verified_per_step'), '.1f'):>6} "
                     f"{num(r['speedup_vs_ar'], '7.2f'):>7}x "
                     f"{num(r['weight_gb_per_s'], '6.1f'):>6} {num(pct, '4.0f'):>4}% "
                     f"{str(r['lossless']).lower():>9} {r['near_ties']:>9} "
                     f"{num(r.get('draft_per_forward'), '.3f'):>9}  {used}")
        if r["drafter"] in OTHER_NUMERICS and r["domain"] == "all":
            lines.append(f"{'':<22} {r['drafter']}'s greedy tokens: {r['same_as_ar']} of {r['n_prompts']} prompts "
                         f"identical to ar's, {100 * r['token_agreement']:.1f}% of tokens before they differ"
                         + ("" if "same_as_own_greedy" not in r else
                            f"; identical to {SPECULATING[r['drafter']]}'s own greedy output on "
                            f"{r['same_as_own_greedy']} of {r['n_prompts']}")
                         + ("" if "decode_tokens_per_s" not in r else
                            f"; its own decode timings: {r['decode_tokens_per_s']:.2f} tok/s"
                            + (" a request" if cfg["concurrency"] > 1 else "")))
    drained = [(r["drafter"] + ("+dcut" if r.get("dcut") else ""), r["drained_tokens_per_s"])
               for r in result["results"] if "drained_tokens_per_s" in r]
    if drained:
        lines.append(f"tok/s at {cfg['concurrency']} in flight: while every slot was busy; whole runs, the "
                     "drain at the end included: " + ", ".join(f"{d} {v:.2f}" for d, v in drained))
    pairs = [(r["drafter"] + ("+dcut" if r.get("dcut") else ""), r["paired_vs_ar"])
             for r in result["results"] if "paired_vs_ar" in r]
    if pairs and pairs[0][1]["batches"] > 1:
        lines.append(f"each batch against ar's run of it (x ar: median [min-max], batches >= ar of "
                     f"{pairs[0][1]['batches']}): " + ", ".join(
                         f"{d} {p['median']:.2f} [{p['min']:.2f}-{p['max']:.2f}] {p['at_least_ar']}"
                         for d, p in pairs))
    if "layers_in_cache_ms" in cfg:
        lines.append(f"a one-row forward's layers after {cfg['layers_context']} tokens: {cfg['layers_served_ms']:.2f} "
                     f"ms as served; {cfg['layers_in_cache_ms']:.2f} ms of compute with their weights in "
                     f"cache and {cfg['layers_stream_ms']:.2f} ms to stream their weights at the machine's "
                     "rate (a forward overlapping the two takes the larger, one that does not their sum)")
    if "llama_bench_tg" in cfg:
        lines.append(f"llama-bench tg{cfg['llama_bench_tg']['tokens']} (llama.cpp's decode figure, same GGUF "
                     f"and threads): {cfg['llama_bench_tg']['tokens_per_s']:.2f} tok/s; llamacpp served by "
                     f"`{cfg['llamacpp_server']}`")
    if "fidelity" in cfg:
        f = cfg["fidelity"]
        lines.append(f"{cfg['weights']} weights against the float32 checkpoint, teacher-forced over the prompts "
                     f"and ar's text ({f['tokens']} tokens): top-1 agreement {100 * f['top1_agreement']:.1f}%, "
                     f"perplexity {f['perplexity_served']} against {f['perplexity_float32']} (lossless is "
                     "against the served weights)")
    vc = result.get("verify_cost")
    if vc:
        ms, ratio = ({int(k): v for k, v in vc[key].items()} for key in ("ms", "ratio_vs_1"))
        lines.append(f"verification cost after {vc['context']} cached tokens: one forward over 1 token "
                     f"{ms[1]:.2f} ms; over k tokens, C(k)/C(1): " +
                     " ".join(f"{k}:{r:.2f}" for k, r in ratio.items() if k > 1))
    return "\n".join(lines)
