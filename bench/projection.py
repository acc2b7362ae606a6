"""A projection, not a measurement: the speedup each drafter would give on a larger target,
from that target's measured verification cost C(k)/C(1) (`angelspec bench --verify-cost` on its
synthetic engine), the acceptance the real drafts reach per domain on the default target, and
their drafting cost scaled by shape.

The model is the usual one of speculative decoding: each draft token is accepted with
probability `a` (the first draft token's measured acceptance, `acc1`) given that the ones
before it were, so a chain of k tokens commits 1 + a + ... + a^k tokens a step, for a step that
costs C(k + 1) / C(1) forwards plus the drafting. It ignores what D-cut and token trees add, so
where acceptance falls with depth faster than geometric it overstates, and where trees pay it
understates.

  python -m angelspec.bench.projection --acceptance docs/results/ACCEPTANCE.json \\
      build/bench-llama-1b.json build/bench-llama-3b.json
"""
from __future__ import annotations

import argparse
import json
import pathlib

DRAFT_VOCAB = 8192  # the trained drafts' head (training/recipes)
MTP_FEATURE_LAYERS = 4
DFLY_LAYERS = 2
MAX_DRAFT = {"ngram": 8, "mtp": 2, "dfly": 3}  # MTP: its trained rollout steps; DFly: a block of 4


def layer_params(cfg: dict) -> int:
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return h * (q + 2 * kv) + q * h + 3 * h * f


def target_params(cfg: dict) -> int:
    """What one forward reads: its layers and its logits' matrix."""
    return cfg["num_hidden_layers"] * layer_params(cfg) + cfg["vocab_size"] * cfg["hidden_size"]


def draft_share(cfg: dict) -> dict[str, float]:
    """Each drafter's weights as a share of the target's, what drafting one token (MTP) or one
    block (DFly) reads: MTP one decoder layer, its feature projection and a draft-vocabulary
    head; DFly two layers and the head."""
    h, head = cfg["hidden_size"], DRAFT_VOCAB * cfg["hidden_size"]
    full = target_params(cfg)
    return {"mtp": (layer_params(cfg) + MTP_FEATURE_LAYERS * h * h + head) / full,
            "dfly": (DFLY_LAYERS * layer_params(cfg) + head) / full, "ngram": 0.0}


def expected_tokens(a: float, k: int) -> float:
    return sum(a ** j for j in range(k + 1))


def best(ratio: dict[int, float], a: float, draft: str, d: float) -> tuple[int, float]:
    """The draft length with the highest tokens per unit of time, and that speedup over ar."""
    def cost(k: int) -> float:
        drafting = k * d if draft == "mtp" else d  # MTP: a pass a token; DFly: a block in one pass
        return ratio[k + 1] + drafting

    ks = [k for k in range(1, MAX_DRAFT[draft] + 1) if k + 1 in ratio]
    k = max(ks, key=lambda k: expected_tokens(a, k) / cost(k))
    return k, expected_tokens(a, k) / cost(k)


def project(bench_json: dict, acceptance: dict, overhead: dict[str, float]) -> list[dict]:
    """Rows of (drafter, domain, CPU and GPU projections) for one synthetic engine's bench JSON."""
    vc = bench_json["verify_cost"]
    cpu = {int(k): v for k, v in vc["ratio_vs_1"].items()}
    gpu = {k: 1.0 for k in cpu}  # a GPU's C(k) is flat for small k: the weights are read once
    cfg = json.loads((pathlib.Path(bench_json["config"]["target"]) / "config.json").read_text())
    share = draft_share(cfg)
    rows = []
    for drafter, domains in acceptance["acc1"].items():
        d = share[drafter] * overhead.get(drafter, 1.0)
        for domain, a in domains.items():
            (kc, sc), (kg, sg) = best(cpu, a, drafter, d), best(gpu, a, drafter, d)
            rows.append({"target": cfg["angelspec_synthetic"]["name"], "drafter": drafter, "domain": domain,
                         "acc1": a, "draft_cost": round(d, 3), "cpu_k": kc, "cpu_speedup": round(sc, 2),
                         "gpu_k": kg, "gpu_speedup": round(sg, 2)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="+", help="bench JSONs of synthetic engines, run with --verify-cost")
    p.add_argument("--acceptance", required=True,
                   help="JSON: acc1 per drafter and domain on the default target, and the drafting "
                        "overhead measured there over the drafter's share of the weights")
    args = p.parse_args(argv)
    acc = json.loads(pathlib.Path(args.acceptance).read_text())
    print("| target | drafter | domain | acc1 | drafting (x a forward) | CPU: k, x ar | GPU (C(k) flat): k, x ar |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for f in args.bench:
        for r in project(json.loads(pathlib.Path(f).read_text()), acc, acc.get("overhead", {})):
            print(f"| {r['target']} | {r['drafter']} | {r['domain']} | {r['acc1']:.2f} | {r['draft_cost']:.3f} "
                  f"| {r['cpu_k']}, {r['cpu_speedup']:.2f}x | {r['gpu_k']}, {r['gpu_speedup']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
