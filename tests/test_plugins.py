"""The system's custom ops (plugins/): opcheck (schema, fake kernels, autograd registration),
and each op against a plain reference of its rule."""
import itertools
import math

import pytest
import torch
from torch.library import opcheck

from angelspec.plugins import RATIOS, dcut_select, interpolate_cost, verify_greedy, verify_rejection
from angelspec.plugins.dfly_head import dfly_draft_head

G = torch.Generator().manual_seed(0)


def chains(lengths) -> torch.Tensor:
    """parents of chain drafts: -1, 0, 1, ... per request."""
    return torch.cat([torch.arange(k) - 1 for k in lengths]).long()


def counts(keep: torch.Tensor, lengths) -> list[int]:
    """A D-cut keep mask -> kept tokens per request."""
    return [int(k.sum()) for k in keep.split(list(lengths))]


def ragged(lengths, vocab=11):
    n = sum(lengths) + len(lengths)
    logits = torch.randn(n, vocab, generator=G)
    draft = torch.randint(0, vocab, (sum(lengths),), generator=G)
    # make some drafts right: copy the target's argmax into the first positions
    best, row, tok = logits.argmax(-1), 0, 0
    for k in lengths:
        for j in range(k):
            if j < k // 2 + 1:
                draft[tok + j] = best[row + j]
        row, tok = row + k + 1, tok + k
    return logits, draft, torch.tensor(lengths)


def test_opcheck_all_ops():
    logits, draft, lengths = ragged([3, 0, 5])
    parents = torch.tensor([-1, 0, 0, -1, 0, 1, 2, 1])  # a tree, nothing, a tree
    opcheck(verify_greedy, (logits, draft, lengths, parents))
    probs = torch.softmax(logits, -1)
    opcheck(verify_rejection, (probs, draft, lengths, parents, torch.rand(len(logits), generator=G)))
    conf = torch.rand(len(draft), generator=G, dtype=torch.float64)
    cost = (torch.tensor([1.0, 8.0, 32.0], dtype=torch.float64), torch.tensor([0.03, 0.04, 0.09], dtype=torch.float64))
    opcheck(dcut_select, (conf, lengths, parents, 0.01, 0.002, *cost, torch.tensor(RATIOS, dtype=torch.float64)))
    h, v, m = 8, 13, 6
    args = (torch.randn(2, 4, h), torch.tensor([3, 5]), torch.randn(v, h), torch.ones(h), torch.ones(h),
            torch.randn(m, 2 * h), torch.randn(m, 2 * h), torch.randn(h, m), torch.ones(h),
            torch.randn(7, h), torch.arange(7) * 2, 1e-5)
    opcheck(dfly_draft_head, args)
    opcheck(dfly_draft_head, args + (torch.randint(0, 7, (2, 4, 3), generator=G),))


def test_verify_greedy_matches_per_request_rule():
    for lengths in ([3, 0, 5], [1], [0, 0], [7, 7, 2, 4]):
        logits, draft, lens = ragged(lengths)
        accepted, last, leaf = verify_greedy(logits, draft, lens, chains(lengths))
        # parents empty: every draft a chain (as the runtime passes chains)
        assert all(torch.equal(a, b) for a, b in zip(
            verify_greedy(logits, draft, lens, torch.zeros(0, dtype=torch.long)), (accepted, last, leaf)))
        row = tok = 0
        for b, k in enumerate(lengths):
            best = logits[row: row + k + 1].argmax(-1)
            a = 0
            while a < k and best[a] == draft[tok + a]:
                a += 1
            assert (int(accepted[b]), int(last[b]), int(leaf[b])) == (a, int(best[a]), a - 1)
            row, tok = row + k + 1, tok + k


def test_verification_names_a_draft_that_does_not_fit_its_rows_or_its_parents():
    logits, draft, lens = ragged([3, 2])
    with pytest.raises(RuntimeError, match="2 requests with 5 draft tokens need 7 rows"):
        verify_greedy(logits[:-1], draft, lens, chains([3, 2]))
    with pytest.raises(RuntimeError, match="token 1 of request 1 has parent 1"):
        verify_greedy(logits, draft, lens, torch.tensor([-1, 0, 1, -1, 1]))


def test_verify_rejection_batched_equals_one_by_one():
    logits, draft, lens = ragged([2, 4, 0, 3])
    probs = torch.softmax(logits / 0.7, -1)
    u = torch.rand(len(probs), generator=G, dtype=torch.float64)
    accepted, last, _ = verify_rejection(probs, draft, lens, chains(lens.tolist()), u)
    # the target's own sample at row r: the first token whose cumulative mass passes u[r]
    own = [int((probs[r].double().cumsum(0) <= u[r] * probs[r].double().sum()).sum())
           for r in range(len(probs))]
    row = tok = 0
    for b, k in enumerate(lens.tolist()):
        a1, l1, _ = verify_rejection(probs[row: row + k + 1], draft[tok: tok + k], torch.tensor([k]),
                                     chains([k]), u[row: row + k + 1])
        a = 0  # the rule: keep drafts while they equal the target's own inverse-CDF sample
        while a < k and own[row + a] == draft[tok + a]:
            a += 1
        assert (int(a1[0]), int(l1[0])) == (int(accepted[b]), int(last[b])) == (a, int(own[row + a]))
        row, tok = row + k + 1, tok + k


def brute_force_dcut(conf, lengths, t_draft, t_fixed, cn, ct):
    """Enumerate every way to keep a prefix of each draft: for each ratio, the best total
    survival among allocations of exactly K tokens; then the utility rule."""
    surv, i = [], 0
    for k in lengths:
        surv.append([math.prod(conf[i: i + j + 1]) for j in range(k)])
        i += k
    total, bs, best = sum(lengths), len(lengths), None
    for r in RATIOS:
        K = math.ceil(r * total - 1e-9)
        top = max(sum(sum(s[:j]) for s, j in zip(surv, alloc))
                  for alloc in itertools.product(*[range(k + 1) for k in lengths]) if sum(alloc) == K)
        c = float(interpolate_cost(torch.tensor([float(bs + K)]), cn, ct)[0])
        u = (bs + top) / (t_draft + c + t_fixed)
        if best is None or u > best[0] * (1 + 1e-12):
            best = (u, r, top)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dcut_global_top_k_is_optimal_and_keeps_prefixes(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (3,), generator=g).tolist()
    conf = torch.rand(sum(lengths), generator=g, dtype=torch.float64)
    slope = float(torch.rand((), generator=g)) * 0.02  # flat to steep verification cost
    cn = torch.tensor([1.0, 4.0, 16.0], dtype=torch.float64)
    ct = 0.03 + slope * (cn - 1)
    ratio, mask = dcut_select(conf, torch.tensor(lengths), chains(lengths), 0.005, 0.001, cn, ct,
                              torch.tensor(RATIOS, dtype=torch.float64))
    keep = torch.tensor(counts(mask, lengths))
    assert all(bool(m[:k].all()) for m, k in zip(mask.split(lengths), keep.tolist()))  # prefixes
    if sum(lengths) == 0:
        return
    u, r, top = brute_force_dcut(conf.tolist(), lengths, 0.005, 0.001, cn, ct)
    assert float(ratio) == r
    assert int(keep.sum()) == math.ceil(r * sum(lengths) - 1e-9)
    i, kept = 0, 0.0  # the kept prefixes reach the best total survival of any allocation
    for n, k in zip(lengths, keep.tolist()):
        kept += sum(math.prod(conf[i: i + j + 1].tolist()) for j in range(k))
        i += n
    assert kept == pytest.approx(top)


def test_dcut_follows_the_cost_curve():
    conf = torch.tensor([0.9, 0.8, 0.5, 0.2, 0.95, 0.3, 0.1, 0.05], dtype=torch.float64)
    lengths, chain = torch.tensor([4, 4]), chains([4, 4])
    cn = torch.tensor([1.0, 64.0], dtype=torch.float64)
    ratios = torch.tensor(RATIOS, dtype=torch.float64)
    flat = dcut_select(conf, lengths, chain, 0.0, 0.0, cn, torch.tensor([0.03, 0.03], dtype=torch.float64), ratios)
    assert float(flat[0]) == 1.0 and counts(flat[1], [4, 4]) == [4, 4]  # free tokens: keep everything
    dear = dcut_select(conf, lengths, chain, 0.0, 0.0, cn, torch.tensor([0.03, 0.975], dtype=torch.float64), ratios)
    assert float(dear[0]) == 0.1875 and counts(dear[1], [4, 4]) == [1, 1]  # each top survival kept
    steep = dcut_select(conf, lengths, chain, 0.0, 0.0, cn, torch.tensor([0.03, 2.0], dtype=torch.float64), ratios)
    assert float(steep[0]) == 0.0 and counts(steep[1], [4, 4]) == [0, 0]  # nothing is worth verifying
    # ties go to the smaller ratio: zero confidence adds nothing
    zero = dcut_select(torch.zeros(8, dtype=torch.float64), lengths, chain, 0.0, 0.0, cn,
                       torch.tensor([0.03, 0.03], dtype=torch.float64), ratios)
    assert float(zero[0]) == 0.0
    # drafting time is paid whatever the ratio: a large T_draft makes keeping more worth it
    mid = torch.tensor([0.03, 0.03 + 63 * 0.004], dtype=torch.float64)
    small = dcut_select(conf, lengths, chain, 0.0, 0.0, cn, mid, ratios)
    big = dcut_select(conf, lengths, chain, 0.5, 0.0, cn, mid, ratios)
    assert float(big[0]) >= float(small[0])


def random_tree(g, k: int) -> list[int]:
    """parents of a random tree of k tokens (each parent an earlier token or the anchor)."""
    return [int(torch.randint(-1, i, (), generator=g)) for i in range(k)]


def test_verify_tree_follows_the_target_down_the_tree():
    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        lengths = torch.randint(0, 7, (3,), generator=g).tolist()
        parents = [random_tree(g, k) for k in lengths]
        logits = torch.randn(sum(lengths) + 3, 4, generator=g)  # 4 tokens: many matches
        own = logits.argmax(-1).tolist()
        draft = torch.randint(0, 4, (sum(lengths),), generator=g)
        accepted, last, leaf = verify_greedy(logits, draft, torch.tensor(lengths),
                                             torch.tensor(sum(parents, [])))
        row = tok = 0
        for b, (k, par) in enumerate(zip(lengths, parents)):
            d = draft[tok: tok + k].tolist()
            ok = {-1: 0}  # token -> depth, for each token whose whole path the target follows
            for i in range(k):
                if par[i] in ok and d[i] == own[row + 1 + par[i]]:
                    ok[i] = ok[par[i]] + 1
            assert int(accepted[b]) == max(ok.values())  # the deepest such token is kept
            assert ok.get(int(leaf[b])) == int(accepted[b])
            assert int(last[b]) == own[row + 1 + int(leaf[b])]
            row, tok = row + k + 1, tok + k


@pytest.mark.parametrize("seed", range(8))
def test_dcut_over_trees_keeps_whole_paths_and_the_best_ones(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 5, (2,), generator=g).tolist()
    parents = [random_tree(g, k) for k in lengths]
    conf = torch.rand(sum(lengths), generator=g, dtype=torch.float64)
    cn = torch.tensor([1.0, 4.0, 16.0], dtype=torch.float64)
    ct = 0.03 + 0.004 * (cn - 1)
    flat = torch.tensor(sum(parents, []))
    ratio, mask = dcut_select(conf, torch.tensor(lengths), flat, 0.005, 0.001, cn, ct,
                              torch.tensor(RATIOS, dtype=torch.float64))
    surv, tok = [], 0
    for k, par in zip(lengths, parents):
        for i in range(k):
            surv.append(float(conf[tok + i]) * (surv[tok + par[i]] if par[i] >= 0 else 1.0))
        tok += k
    glob = [tok + p if p >= 0 else -1 for tok, par in zip([0, lengths[0]], parents) for p in par]
    kept = mask.tolist()
    assert all(not kept[i] or glob[i] < 0 or kept[glob[i]] for i in range(len(kept)))  # closed
    # no set of as many tokens, each with its parent, survives better
    closed = [c for c in itertools.product([False, True], repeat=len(kept)) if sum(c) == sum(kept)
              and all(not c[i] or glob[i] < 0 or c[glob[i]] for i in range(len(c)))]
    best = max(sum(s for s, c in zip(surv, cs) if c) for cs in closed)
    assert sum(s for s, k in zip(surv, kept) if k) == pytest.approx(best)


def test_dfly_draft_head_is_the_greedy_chain():
    import torch.nn.functional as F

    from angelspec.drafters.modules import SwiGLU

    h, v, vd = 16, 50, 20
    embed, lm = torch.randn(v, h, generator=G), torch.randn(vd, h, generator=G)
    ids = torch.randperm(v, generator=G)[:vd]
    ar = SwiGLU(2 * h, 24, h)
    hn_w, pn_w, fn_w = (torch.rand(h, generator=G) + 0.5 for _ in range(3))
    hidden = torch.randn(3, 5, h, generator=G)  # three blocks' chains in one call
    anchors = [7, 0, 31]
    tokens, conf = dfly_draft_head(hidden, torch.tensor(anchors), embed, hn_w, pn_w, ar.gate.weight.detach(),
                                   ar.up.weight.detach(), ar.down.weight.detach(), fn_w, lm, ids, 1e-5)
    with torch.no_grad():
        for b, prev in enumerate(anchors):
            for i in range(5):
                x = torch.cat([F.rms_norm(hidden[b, i], (h,), hn_w, 1e-5),
                               F.rms_norm(embed[prev], (h,), pn_w, 1e-5)])
                y = F.rms_norm(hidden[b, i] + ar(x), (h,), fn_w, 1e-5)
                p = torch.softmax(lm @ y, -1)
                prev = int(ids[p.argmax()])
                assert int(tokens[b, i, 0]) == prev
                assert float(conf[b, i, 0]) == pytest.approx(float(p.max()), rel=1e-5)


def test_ops_trace_under_torch_compile():
    logits, draft, lengths = ragged([2, 3])
    parents = chains([2, 3])
    f = torch.compile(lambda a, b, c, d: verify_greedy(a, b, c, d), backend="eager", fullgraph=True)
    assert [t.tolist() for t in f(logits, draft, lengths, parents)] == \
        [t.tolist() for t in verify_greedy(logits, draft, lengths, parents)]
