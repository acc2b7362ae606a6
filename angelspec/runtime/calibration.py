"""How far each drafter's confidences hold, measured on the tokens D-cut verified.

D-cut verifies the draft tokens whose survival (the product of the confidences on their path)
pays for the extra verification. The tokens it picks are those whose confidence runs highest,
and a confidence that runs high partly by chance (a request's running rate of acceptance, a
draft model's softmax) is picked more often than one that runs low: on the tokens it keeps, a
drafter's confidences are too high on average. Where a verified token costs nearly what it can
bring (a CPU verifying 16 requests at once), D-cut then verifies tokens that do not pay: with
16 requests in flight on a 2-core CPU, `ngram`'s kept tokens were accepted at 0.6 where their
confidences promised more than the 0.69 they needed.

So for every drafter and depth d (1 = a child of the anchor), over the verified tokens whose
parent was accepted (each judged on its own), the engine keeps the tokens accepted and the sum
of their confidences; D-cut reads confidence x (accepted + PRIOR) / (confidence sum + PRIOR),
at most 1. Both sums forget old steps (they are scaled down once the confidences pass WINDOW),
so the factor follows a drafter through load and content. A calibrated confidence is at most 1,
so survival still never grows along a path and D-cut keeps parents before children.
Calibration only decides what is verified: the output is the same token for token.
"""
from __future__ import annotations

from angelspec.drafters import Proposal

PRIOR = 8.0  # pseudo-tokens at factor 1
WINDOW = 256.0  # confidence mass remembered per (drafter, depth)
MAX_DEPTH = 8  # deeper tokens share the last depth's factor


class Calibration:
    def __init__(self):
        self.sums: dict[str, list[list[float]]] = {}  # drafter -> per depth [accepted, confidence]

    def factor(self, name: str, depth: int) -> float:
        rows = self.sums.get(name)
        if rows is None:
            return 1.0
        hit, conf = rows[min(depth, MAX_DEPTH) - 1]
        return (hit + PRIOR) / (conf + PRIOR)

    def apply(self, name: str, prop: Proposal) -> list[float]:
        """The proposal's confidences as D-cut should read them."""
        conf = prop.confidence.tolist()
        if name not in self.sums:
            return conf
        return [min(c * self.factor(name, d), 1.0) for c, d in zip(conf, prop.depths())]

    def observe(self, name: str, prop: Proposal, path: list[int]) -> None:
        """A verified proposal (its raw confidences) and the indices of its accepted tokens."""
        if not len(prop.tokens):
            return
        rows = self.sums.setdefault(name, [[0.0, 0.0] for _ in range(MAX_DEPTH)])
        accepted = set(path)
        for i, (p, d, c) in enumerate(zip(prop.parent_list(), prop.depths(),
                                          prop.confidence.tolist())):
            if p >= 0 and p not in accepted:
                continue  # its parent failed: this token was never judged
            row = rows[min(d, MAX_DEPTH) - 1]
            row[0] += i in accepted
            row[1] += c
            if row[1] > WINDOW:
                row[0] *= WINDOW / row[1]
                row[1] = WINDOW
