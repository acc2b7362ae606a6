"""Trained drafters (mtp, dfly, dflash) on tiny random targets: the block mask, the TTT rollout,
the AR head at initialisation, training equals serving, checkpoints, and lossless decoding; and
the ngram drafter's datastore."""
import pytest
import torch
from conftest import make_checkpoint

from angelspec.checkpoint import CheckpointError, load_target
from angelspec.drafters import make_drafter
from angelspec.drafters.dfly import DFly
from angelspec.drafters.draft_checkpoint import DraftConfig, load_draft, save_draft
from angelspec.drafters.modules import Frozen, Linear
from angelspec.drafters.mtp import MTP
from angelspec.drafters.target_layers import dfly_layers, mtp_layers
from angelspec.model import Segment
from angelspec.plugins import QuantWeight
from angelspec.runtime import Engine, Request, SamplingParams
from angelspec.runtime.engine import RequestState
from angelspec.training.objectives import (
    accepted_at,
    block_hidden,
    block_objective,
    chain_accepted,
    depth_acceptance,
    greedy_chain,
    own_chain,
    rollout,
    served_steps,
    ttt_rollout,
    walk,
)
from angelspec.weights import serve


@pytest.fixture(scope="module")
def target8(tmp_path_factory):
    """An 8-layer tiny target (5 distinct DFly layers) with a character tokenizer."""
    path = tmp_path_factory.mktemp("tiny8")
    make_checkpoint(path, num_hidden_layers=8, seed=3)
    return load_target(path, max_len=512)


def draft(target, kind, vocab=0, seed=0, **kw):
    """A randomly initialised draft (AR head weights made non-zero so it matters); kind "mtp<k>":
    an MTP draft reading k target layers."""
    n = target.config.num_layers
    if kind.startswith("mtp"):
        cfg = DraftConfig.for_target(target, "mtp", target_layers=mtp_layers(n, int(kind[3:] or 1)),
                                     draft_vocab=vocab)
        model = MTP(cfg)
    else:
        on = kind == "dfly"
        cfg = DraftConfig.for_target(target, kind, target_layers=dfly_layers(n), num_layers=2,
                                     block_size=kw.get("block_size", 6), draft_len=kw.get("block_size", 6) - 1,
                                     hybrid=kw.get("hybrid", on), ar_head=kw.get("ar_head", on),
                                     draft_vocab=vocab)
        model = DFly(cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        if vocab:
            model.vocab_ids.copy_(torch.randperm(cfg.vocab_size)[:vocab].sort().values)
    return cfg, model.eval()


def features(target, tokens: list[int], layers) -> dict:
    n = len(tokens)
    _, hidden = target.model.forward(torch.tensor(tokens), target.model.batch([Segment(0, 0, n)]),
                                     target.model.new_cache(1, n), capture=tuple(layers))
    return {l: h.clone() for l, h in hidden.items()}


def state_at(tokens, n, drafter, feats, temperature=0.0, slot=0):
    """A request in cache slot `slot` whose target cache holds tokens[:n] and whose newest token
    is tokens[n]."""
    s = RequestState(0, list(tokens[: n + 1]), 1, SamplingParams(temperature=temperature), "x",
                     torch.Generator().manual_seed(0) if temperature else None, slot=slot)
    view = s.view("x")
    drafter.on_commit(view, {l: feats[l][:n] for l in drafter.capture})
    return view


def served(target, tmp_path, cfg, model, k=None):
    save_draft(tmp_path / cfg.kind, cfg, model.state_dict())
    return make_drafter(cfg.kind, k, target, tmp_path)


def test_ttt_rollout_feeds_own_tokens_from_step_2(target8):
    cfg, model = draft(target8, "mtp")
    fz = Frozen(target8.model, model.vocab_ids)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (1, 24), generator=g)
    h = features(target8, tokens[0].tolist(), [8])[8][None]
    base = rollout(model, fz, tokens, h, steps=4)
    i = 6
    changed = tokens.clone()
    changed[0, i + 2] = (changed[0, i + 2] + 5) % 96  # what teacher forcing would feed at step 2
    after = rollout(model, fz, changed, h, steps=4)
    for step in (1, 2, 3, 4):  # base i reads t[i+1] and its own tokens only
        assert torch.allclose(base[step - 1][0, i], after[step - 1][0, i], atol=1e-5)
    assert not torch.allclose(base[0][0, i + 1], after[0][0, i + 1])  # t[i+2] does matter there


def test_ttt_loss_over_labelled_bases_equals_the_loss_over_every_position(target8):
    """ttt_rollout rolls out only from bases that have a label; nothing else changes."""
    import torch.nn.functional as F

    cfg, model = draft(target8, "mtp")
    fz = Frozen(target8.model, model.vocab_ids)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (2, 30), generator=g)
    label_ok = torch.zeros(2, 30, dtype=torch.bool)
    label_ok[0, 12:30], label_ok[1, 20:27] = True, True  # prompts of 12 and 20, padding after 27
    h = torch.stack([features(target8, t.tolist(), [8])[8] for t in tokens])
    loss, metrics = ttt_rollout(model, fz, tokens, label_ok, {8: h}, steps=4, draft_len=3)
    full = rollout(model, fz, tokens, h, steps=4)  # every base position
    losses, hits = [], []
    for k, logits in enumerate(full, 1):
        lab = torch.full((2, 29), -1)
        lab[:, : 29 - k] = fz.index[tokens[:, k + 1:]]
        ok = torch.zeros(2, 29, dtype=torch.bool)
        ok[:, : 29 - k] = label_ok[:, k + 1:]
        losses.append(F.cross_entropy(logits[ok], lab[ok]))
        hits.append(float(((logits.argmax(-1) == lab) & ok).sum()) / int(ok.sum()))
    torch.testing.assert_close(loss, sum(losses) / 4)
    assert [metrics[f"acc{k}"] for k in (1, 2, 3, 4)] == pytest.approx(hits)


def target_distribution(target, h: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The target's own next-token distribution from its last hidden states [..., h] (its final
    norm and lm_head), restricted to `vocab_ids` and renormalised there."""
    logits = target.model.head(h.reshape(-1, h.shape[-1])).reshape(*h.shape[:-1], -1)
    return torch.softmax(logits[..., vocab_ids], -1)


def kl(p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return (p * (p.log() - torch.log_softmax(logits, -1))).sum(-1)


def test_soft_labels_distil_the_targets_distribution_over_the_draft_vocabulary(target8):
    """Soft labels: step k from base i is KL(p || q), p the target's own distribution after
    position i+k (its head on the cached last hidden state) renormalised over the draft
    vocabulary, for MTP's rollout and for DFly's blocks (decayed by block position)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (2, 30), generator=g)
    h = torch.stack([features(target8, t.tolist(), [8])[8] for t in tokens])
    label_ok = torch.zeros(2, 30, dtype=torch.bool)
    label_ok[0, 12:30], label_ok[1, 20:27] = True, True
    cfg, model = draft(target8, "mtp", vocab=40)
    fz = Frozen(target8.model, model.vocab_ids)
    p = target_distribution(target8, h, model.vocab_ids)  # p[:, j]: after position j
    loss, _ = ttt_rollout(model, fz, tokens, label_ok, {8: h}, steps=3, draft_len=3, soft=True)
    full = rollout(model, fz, tokens, h, steps=3)
    expect = []
    for k, logits in enumerate(full, 1):
        ok = torch.zeros(2, 29, dtype=torch.bool)
        ok[:, : 29 - k] = label_ok[:, k + 1:]
        expect.append(kl(p[:, k: k + 29 - k], logits[:, : 29 - k])[ok[:, : 29 - k]].mean())
    torch.testing.assert_close(loss, sum(expect) / 3)

    cfg, model = draft(target8, "dfly", vocab=40)
    fz = Frozen(target8.model, model.vocab_ids)
    p = target_distribution(target8, h, model.vocab_ids)
    feats = {l: torch.stack([features(target8, t.tolist(), [l])[l] for t in tokens]) for l in cfg.target_layers}
    feats[8] = h
    anchors, valid = torch.tensor([[12, 18], [20, 20]]), torch.tensor([[True, True], [True, False]])
    loss, _ = block_objective(model, fz, tokens, label_ok, feats, anchors, valid, soft=True, gamma=2.0)
    hidden = block_hidden(model, fz, tokens, feats, anchors)
    prev = tokens.gather(1, (anchors[..., None] + torch.arange(5)).flatten(1)).view(2, 2, 5)
    q = fz.logits(model.head(hidden, fz.embed[prev]))
    w = torch.exp(-torch.arange(5.0) / 2.0)
    num = den = 0
    for s, a in ((0, 0), (0, 1), (1, 0)):
        at = int(anchors[s, a])
        num = num + (kl(p[s, at: at + 5], q[s, a]) * w).sum()
        den = den + w.sum()
    torch.testing.assert_close(loss, num / den)


def test_the_ar_head_trained_on_its_own_chain_runs_the_served_chain(target8):
    """own=1: every link reads its own previous link's argmax, the chain greedy serving runs
    (greedy_chain); own=0 is teacher forcing."""
    cfg, model = draft(target8, "dfly", vocab=40)
    fz = Frozen(target8.model, model.vocab_ids)
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(8))
    feats = features(target8, tokens[0].tolist(), sorted(set(cfg.target_layers) | {8}))
    feats = {l: f[None] for l, f in feats.items()}
    anchors = torch.tensor([[6, 14, 20]])
    hidden = block_hidden(model, fz, tokens, feats, anchors)
    prev = tokens.gather(1, (anchors[..., None] + torch.arange(5)).flatten(1)).view(1, 3, 5)
    mine = torch.tensor([[True, False, True]])
    logits = own_chain(model, fz, hidden, prev, mine)
    served = greedy_chain(model, fz, hidden, tokens.gather(1, anchors))
    assert torch.equal(logits[mine].argmax(-1), served[mine])
    forced = fz.logits(model.head(hidden, fz.embed[prev]))
    torch.testing.assert_close(logits[~mine], forced[~mine])


def test_the_walk_runs_the_ar_chain_link_by_link_as_served(target8):
    """chain_accepted (links run only while every link before matched) counts what the full
    greedy chain's leading matches count, on chains that match 0..B-1 links."""
    cfg, model = draft(target8, "dfly", vocab=40)
    with torch.no_grad():  # a head that reads its previous token (it starts at zero)
        for p in model.ar.parameters():
            p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    fz = Frozen(target8.model, model.vocab_ids)
    tokens = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(9))
    feats = features(target8, tokens[0].tolist(), sorted(set(cfg.target_layers)))
    anchors = torch.arange(4, 20)
    hidden = block_hidden(model, fz, tokens, {l: f[None] for l, f in feats.items()}, anchors[None])[0]
    served = fz.vocab_ids[greedy_chain(model, fz, hidden, tokens[0, anchors])]
    truth = served.clone()
    for a in range(len(anchors)):  # block a matches its first a % B links, then misses
        truth[a, a % served.shape[1]:] = -1
    truth[0] = served[0]  # and one block matches every link
    got = chain_accepted(model, fz, hidden, tokens[0, anchors], truth)
    assert torch.equal(got, (served == truth).int().cumprod(-1).sum(-1))
    assert got.max() == served.shape[1] and got.min() == 0


def test_served_steps_and_acceptance_per_depth():
    """Each verification step's accepted drafts along the walk; alpha_d: of the steps that
    accepted d-1, the share accepting the d-th."""
    acc = torch.tensor([9, 2, 9, 9, 0, 1, 9, 4, 9])
    assert served_steps(acc, 1) == [2, 0, 1, 0] and walk(acc, 1) == (7, 4)  # the last one cut at the end
    assert depth_acceptance([2, 0, 1, 3], 3) == pytest.approx([3 / 4, 2 / 3, 1 / 2])


@pytest.mark.parametrize("kind,vocab", [("mtp", 0), ("mtp", 40), ("mtp3", 40)])
def test_mtp_training_equals_serving(target8, tmp_path, kind, vocab):
    cfg, model = draft(target8, kind, vocab=vocab)
    drafter = served(target8, tmp_path, cfg, model, k=3)
    fz = drafter.frozen
    tokens = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    feats = features(target8, tokens, cfg.target_layers)
    h = drafter.model.features({l: f[None] for l, f in feats.items()})
    logits = rollout(drafter.model, fz, torch.tensor([tokens]), h, steps=3)
    for n in (5, 17, 28):
        prop = drafter.propose([state_at(tokens, n, drafter, feats)])[0]
        expect = [int(fz.vocab_ids[l[0, n - 1].argmax()]) for l in logits]
        assert prop.tokens.tolist() == expect
        assert ((prop.confidence > 0) & (prop.confidence <= 1)).all()


def test_block_mask(target8):
    cfg, model = draft(target8, "dfly")
    fz = Frozen(target8.model, model.vocab_ids)
    T = 32
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 96, (1, T), generator=g)
    feats = {l: torch.randn(1, T, cfg.hidden_size, generator=g) for l in cfg.target_layers + [8]}
    anchors = torch.tensor([[5, 12, 20]])
    base = block_hidden(model, fz, tokens, feats, anchors)
    # the block at 12 sees features before 12 and its own anchor token; nothing else
    f2 = {l: f.clone() for l, f in feats.items()}
    t2 = torch.randint(0, 96, (1, T), generator=g)
    t2[0, 12] = tokens[0, 12]
    for f in f2.values():
        f[0, 12:] += 1.0
    after = block_hidden(model, fz, t2, f2, anchors)
    assert torch.allclose(base[0, 1], after[0, 1], atol=1e-5)
    assert not torch.allclose(base[0, 2], after[0, 2])  # the block at 20 sees 12..19
    assert not torch.allclose(base[0, 0], after[0, 0])  # its anchor token changed
    f3 = {l: f.clone() for l, f in feats.items()}
    for f in f3.values():
        f[0, 11] += 1.0
    assert not torch.allclose(base[0, 1], block_hidden(model, fz, tokens, f3, anchors)[0, 1])


def test_ar_head_is_a_no_op_at_initialisation(target8):
    """Untrained AR head (zero down projection) and no hybrid conditioning: DFly == DFlash."""
    n = target8.config.num_layers
    common = dict(target_layers=dfly_layers(n), num_layers=2, block_size=6, hybrid=False)
    fly = DFly(DraftConfig.for_target(target8, "dfly", ar_head=True, **common))
    flash = DFly(DraftConfig.for_target(target8, "dflash", ar_head=False, **common))
    missing, unexpected = flash.load_state_dict(fly.state_dict(), strict=False)
    assert not missing and all(k.startswith(("ar.", "prev_norm", "head_norm")) for k in unexpected)
    fz = Frozen(target8.model, fly.vocab_ids)
    tokens = torch.randint(0, 96, (1, 30), generator=torch.Generator().manual_seed(5))
    feats = features(target8, tokens[0].tolist(), dfly_layers(n))
    feats = {l: f[None] for l, f in feats.items()}
    anchors = torch.tensor([[8, 15]])
    h = block_hidden(fly, fz, tokens, feats, anchors)
    assert torch.equal(h, block_hidden(flash, fz, tokens, feats, anchors))
    prev = fz.embed[tokens[0, :5]][None, None].expand(1, 2, -1, -1)
    assert torch.equal(fly.head(h[..., :5, :], prev), flash.head(h[..., :5, :], prev))


@pytest.mark.parametrize("kind,vocab,rescore", [("dfly", 0, 16), ("dfly", 40, 16), ("dfly", 40, 0),
                                                ("dflash", 0, 16)])
def test_block_training_equals_serving(target8, tmp_path, kind, vocab, rescore):
    cfg, model = draft(target8, kind, vocab=vocab)
    cfg.rescore_top_k = rescore
    drafter = served(target8, tmp_path, cfg, model)
    fz = drafter.frozen
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(6)).tolist()
    feats = features(target8, tokens, cfg.target_layers)
    batch = torch.tensor([tokens])
    stop, shorter = drafter.stop_below, []
    for n in (4, 21, 33):
        hidden = block_hidden(drafter.model, fz, batch, {l: f[None] for l, f in feats.items()},
                              torch.tensor([[n]]))
        expect = greedy_chain(drafter.model, fz, hidden, torch.tensor([[tokens[n]]])) \
            if cfg.ar_head else fz.logits(hidden).argmax(-1)
        drafter.stop_below = 0.0  # the whole chain
        prop = drafter.propose([state_at(tokens, n, drafter, feats)])[0]
        assert prop.tokens.tolist() == fz.vocab_ids[expect[0, 0]].tolist()
        assert len(prop.tokens) == cfg.block_size - 1
        if cfg.ar_head:  # served: the chain up to its first token whose path survival is below stop
            drafter.stop_below = stop
            cut = drafter.propose([state_at(tokens, n, drafter, feats)])[0]
            keep = int((prop.confidence.double().cumprod(0) >= stop).sum())
            assert cut.tokens.tolist() == prop.tokens[:keep].tolist()
            shorter.append(keep < len(prop.tokens))
    assert any(shorter) or not cfg.ar_head


def test_checkpoint_round_trip_and_mismatch(target8, tmp_path):
    cfg, model = draft(target8, "dfly", vocab=40)
    save_draft(tmp_path / "d", cfg, model.state_dict())
    cfg2, state = load_draft(tmp_path / "d", target8)
    assert cfg2 == cfg
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    other = tmp_path / "other"
    make_checkpoint(other, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(CheckpointError, match="hidden size: draft 64, target 32"):
        load_draft(tmp_path / "d", load_target(other))
    with pytest.raises(CheckpointError, match="no trained draft"):
        make_drafter("mtp", None, target8, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="holds a dfly draft, not mtp"):
        save_draft(tmp_path / "mtp", cfg, model.state_dict())
        make_drafter("mtp", None, target8, tmp_path)


@pytest.mark.parametrize("kind", ["mtp", "mtp3", "dfly", "dflash"])
def test_greedy_lossless_with_trained_drafters(target8, tmp_path, kind):
    """Random drafts (mostly wrong) and the target's own greedy path must give the same tokens."""
    cfg, model = draft(target8, kind, vocab=60 if kind != "dflash" else 0)
    kind = cfg.kind
    save_draft(tmp_path / kind, cfg, model.state_dict())
    g = torch.Generator().manual_seed(7)
    # 150 tokens: the drafts' own KV caches start at 64 positions and must grow past twice that
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (3, 11, 150)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = Engine(target8, max_batch=1, max_len=200).generate(
        [Request(p, params, "none") for p in prompts])
    for batch, spec in ((1, kind), (3, kind), (1, f"{kind}:branches=3"), (3, f"{kind}:branches=2"),
                        (3, f"ngram+{kind}:branches=2")):
        eng = Engine(target8, max_batch=batch, max_len=200, drafts=str(tmp_path))
        out = eng.generate([Request(p, params, spec) for p in prompts])
        assert [r.tokens for r in out] == [r.tokens for r in ref], spec
        assert sum(r.stats.drafted for r in out) > 0


@pytest.mark.parametrize("weights", ["float32", "w4a8"])
@pytest.mark.parametrize("kind,vocab", [("mtp", 0), ("mtp3", 40)])
def test_mtp_fused_proposal_is_the_op_by_op_one(target8, tmp_path, kind, vocab, weights):
    """Greedy chains take the one-call path (angelspec::MTPDraft), sampled requests the op-by-op
    one; at temperature 1 a sampled request's confidences are the plain softmax, so both paths
    must propose the same tokens with the same confidences, from fresh caches and after more
    positions are committed, for two requests at once."""
    cfg, model = draft(target8, kind, vocab=vocab)
    target = load_target(target8.path, max_len=512)
    if weights != "float32":
        serve(target.model, weights)
    save_draft(tmp_path / cfg.kind, cfg, model.state_dict())
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (12, 40)]
    feats = [features(target, t, cfg.target_layers) for t in seqs]
    for temperature in (0.0, 1.0):
        drafter = make_drafter(cfg.kind, 4, target, tmp_path)
        views = [state_at(t, 5, drafter, f, temperature, slot=i) for i, (t, f) in enumerate(zip(seqs, feats))]
        props = [drafter.propose(views)]
        for v, t, f in zip(views, seqs, feats):
            v.req.tokens[:] = t[:-1]
            drafter.on_commit(v, {l: f[l][5: len(t) - 2] for l in drafter.capture})
        props.append(drafter.propose(views))
        if temperature == 0.0:
            fused = props
    for ps, qs in zip(fused, props):
        for p, q in zip(ps, qs):
            assert p.tokens.tolist() == q.tokens.tolist() and len(p.tokens) == 4
            torch.testing.assert_close(p.confidence, q.confidence, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("weights", ["float32", "w4a8"])
def test_dfly_head_in_one_call_is_draft_head(target8, tmp_path, weights):
    """DFly's chains over the whole draft vocabulary run as one C++ call (angelspec::DFlyHead);
    they are plugins.dfly_head.draft_head's link by link, over the same served weights: the
    same tokens, the same confidences, widths 1 and 3, stopping where every chain's survival
    drops below a threshold."""
    from angelspec.plugins.dfly_head import draft_head
    cfg, model = draft(target8, "dfly", vocab=64)
    target = load_target(target8.path, max_len=512)
    if weights != "float32":
        serve(target.model, weights)
    drafter = served(target, tmp_path, cfg, model)
    d, fz = drafter.model, drafter.frozen
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(3, 5, cfg.hidden_size, generator=g)
    anchors = torch.tensor([7, 0, 31])
    for width, stop in ((1, 0.0), (3, 0.0), (1, 0.5)):
        t, c = drafter.head.chains(hidden, anchors, width, stop)
        rt, rc = draft_head(hidden, anchors, fz.embed, d.head_norm.weight, d.prev_norm.weight,
                            d.ar.gate.serving_weight, d.ar.up.serving_weight, d.ar.down.serving_weight,
                            fz.norm_w, fz.head_mm, fz.vocab_ids, fz.eps, None, width, stop)
        assert t.tolist() == rt.tolist() and t.shape[1] == (5 if not stop else rt.shape[1])
        torch.testing.assert_close(c, rc, rtol=1e-4, atol=1e-6)
    assert t.shape[1] < 5  # the threshold did stop the chains


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_drafts_serve_in_the_engines_quantized_scheme_losslessly(target8, tmp_path, kind):
    """On an engine serving w4a8 weights, a draft's matmuls (its layers, DFly's AR head, the draft
    vocabulary's lm_head) run in the same scheme and kernels; the output stays the engine's own."""
    cfg, model = draft(target8, kind, vocab=64)
    save_draft(tmp_path / kind, cfg, model.state_dict())
    target = load_target(target8.path, max_len=512)
    serve(target.model, "w4a8")
    drafter = make_drafter(kind, None, target, tmp_path)
    layers = [m for m in drafter.model.modules() if isinstance(m, Linear)]
    assert layers and all(isinstance(m.serving_weight, QuantWeight) and m.serving_weight.int8_activations
                          and m.serving_weight.bits == 4 for m in layers)
    assert isinstance(drafter.frozen.head_mm, QuantWeight) and drafter.frozen.head_mm.bits == 8
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (4, 20)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = Engine(target, max_batch=1, max_len=200).generate([Request(p, params, "none") for p in prompts])
    eng = Engine(target, max_batch=2, max_len=200, drafts=str(tmp_path))
    out = eng.generate([Request(p, params, kind) for p in prompts])
    assert [r.tokens for r in out] == [r.tokens for r in ref]
    assert sum(r.stats.drafted for r in out) > 0


@pytest.mark.parametrize("kind", ["mtp", "mtp3", "dfly", "dflash"])
def test_batched_drafting_proposes_what_one_request_at_a_time_does(target8, tmp_path, kind):
    """A trained drafter drafts for the whole batch in one pass (its weights read once); each
    request gets the proposal it would get alone, twice in a row (the second time from the
    caches the first one filled, after newly committed positions)."""
    cfg, model = draft(target8, kind, vocab=60 if kind != "dflash" else 0)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (9, 17, 30)]
    feats = [features(target8, t, sorted(set(cfg.target_layers))) for t in seqs]
    together = served(target8, tmp_path / "a", cfg, model)
    alone = served(target8, tmp_path / "b", cfg, model)
    views = {}
    for cut in (5, 0):  # a prefix of each sequence first, then the rest of it committed
        for i, t in enumerate(seqs):
            n = len(t) - 1 - cut
            for who in (together, alone):
                v = views.get((who, i))
                if v is None:
                    views[who, i] = state_at(t, n, who, feats[i], slot=i)
                else:
                    old = len(v.req.tokens) - 1
                    v.req.tokens[:] = t[: n + 1]
                    who.on_commit(v, {l: feats[i][l][old:n] for l in who.capture})
        batch = together.propose([views[together, i] for i in range(len(seqs))])
        single = [alone.propose([views[alone, i]])[0] for i in range(len(seqs))]
        for p, q in zip(batch, single):
            assert p.tokens.tolist() == q.tokens.tolist()
            torch.testing.assert_close(p.confidence, q.confidence, rtol=1e-4, atol=1e-6)
        # DFly's chains stop where their survival drops (DFlyDrafter.stop_below), each its own way
        assert all(len(p.tokens) == together.draft_len or kind == "dfly" for p in batch)


@pytest.mark.parametrize("kind", ["mtp", "dfly", "dflash"])
def test_trained_drafters_grow_trees_around_their_chain(target8, tmp_path, kind):
    """branches=3: the chain a drafter proposes alone comes first, then the runners-up along it,
    then its other first guesses continued; for the whole batch as for one request alone."""
    cfg, model = draft(target8, kind, vocab=60 if kind != "dflash" else 0)
    g = torch.Generator().manual_seed(12)
    seqs = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (9, 30)]
    chain = served(target8, tmp_path / "c", cfg, model)
    chain.stop_below = 0.0  # DFly: the whole chain, as a tree's first path is
    save_draft(tmp_path / "t" / kind, cfg, model.state_dict())
    tree = make_drafter(f"{kind}:branches=3", None, target8, tmp_path / "t")
    views = lambda d: [state_at(t, len(t) - 1, d, features(target8, t, sorted(set(cfg.target_layers))),  # noqa: E731
                                slot=i) for i, t in enumerate(seqs)]
    chains, trees = chain.propose(views(chain)), tree.propose(views(tree))
    alone = [tree.propose([v])[0] for v in views(tree)]
    k = chain.draft_len
    for c, t, a in zip(chains, trees, alone):
        assert c.parents is None and t.parents is not None
        assert t.tokens[:k].tolist() == c.tokens.tolist() and t.parents[:k].tolist() == list(range(-1, k - 1))
        firsts = t.tokens[t.parents == -1].tolist()
        assert len(firsts) == len(set(firsts)) == 3  # three different first guesses
        assert t.depth() == k and len(t.tokens) == k + 2 * (k - 1) + 2 * (k - 1) + 2
        assert t.tokens.tolist() == a.tokens.tolist() and t.parents.tolist() == a.parents.tolist()
        assert bool((t.confidence > 0).all() and (t.confidence <= 1).all())


@pytest.mark.parametrize("vocab", [[78], [17, 78]])
@pytest.mark.parametrize("kind", ["mtp", "mtp3", "dfly", "dflash"])
def test_validation_walk_counts_what_serving_counts(target8, tmp_path, kind, vocab):
    """Training's held-out accept length (accepted_at + walk over the target's own response) is
    the engine's: the same verification steps and committed tokens. A draft vocabulary of the
    tokens the target's response repeats most (78, then 17) gets drafts accepted in runs; with
    two, what the draft proposes depends on its inputs."""
    cfg, model = draft(target8, kind, vocab=len(vocab))
    kind = cfg.kind
    model.vocab_ids.copy_(torch.tensor(vocab))
    save_draft(tmp_path / kind, cfg, model.state_dict())
    prompt = torch.randint(1, 96, (3,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    out = Engine(target8, max_batch=1, max_len=200, drafts=str(tmp_path)).generate(
        [Request(prompt, params, kind)])[0]
    tokens = prompt + out.tokens
    feats = features(target8, tokens, sorted(set(cfg.target_layers) | {8}))
    acc = accepted_at(model, Frozen(target8.model, model.vocab_ids), torch.tensor(tokens), feats,
                      len(prompt), cfg.draft_len)
    assert walk(acc, len(prompt)) == (out.stats.committed, out.stats.steps)
    assert out.stats.accepted >= 5


def test_walk_jumps_over_what_each_step_accepted():
    """A step at p commits accepted[p] + 1 tokens, never past the last, and the next starts there:
    steps at 1, 4, 5 and 7 (the last commits 1 of its 5); 0, 2, 3, 6 and 8 are jumped over."""
    assert walk(torch.tensor([9, 2, 9, 9, 0, 1, 9, 4, 9]), 1) == (7, 4)


def test_sampling_with_trained_drafter_is_seeded(target8, tmp_path):
    cfg, model = draft(target8, "dfly", vocab=60)
    save_draft(tmp_path / "dfly", cfg, model.state_dict())
    eng = Engine(target8, max_batch=2, max_len=128, drafts=str(tmp_path))

    def run(seed, drafter="dfly"):
        p = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)
        return eng.generate([Request([5, 6, 7], p, drafter)])[0].tokens
    assert run(1) == run(1) == run(1, "none")
    assert run(1) != run(2)


def test_serving_options(target8, tmp_path):
    """`name:key=value` serves a variant: draft length, candidate re-scoring, full vocabulary."""
    cfg, model = draft(target8, "dfly", vocab=40)
    save_draft(tmp_path / "dfly", cfg, model.state_dict())
    eng = Engine(target8, max_batch=1, max_len=128, drafts=str(tmp_path))
    assert eng.drafter("dfly:draft_len=2").draft_len == 2
    assert eng.drafter("dfly:rescore_top_k=16").cfg.rescore_top_k == 16
    assert len(eng.drafter("dfly:draft_vocab=0").frozen.vocab_ids) == 97
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = [eng.generate([Request([3, 4, 5], params, d)])[0] for d in
            ("none", "dfly:draft_len=2", "dfly:rescore_top_k=16", "dfly:draft_vocab=0")]
    assert all(o.tokens == outs[0].tokens for o in outs)
    assert outs[1].stats.drafted <= 2 * outs[1].stats.steps
    for bad in ("dfly:block=4", "dfly:draft_vocab=10", "dfly:rescore"):
        with pytest.raises(ValueError, match="dfly"):
            eng.drafter(bad)


def test_ngram_datastore_picks_the_most_frequent_continuation_and_round_trips(tmp_path):
    """The datastore keeps, per n-gram, the continuation that most often followed it (token by
    token); the drafter prefers a context match of 2+ tokens, then the datastore, then a context
    1-gram; a datastore built with another tokenizer is refused with a warning."""
    from types import SimpleNamespace

    from angelspec.drafters import Datastore, NgramDrafter

    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 7, 8], [2, 3, 4, 5]]
    store = Datastore.build(seqs, max_ngram=2, width=3)
    assert store.lookup([50, 2, 3], 3) == ([4, 5], 2)  # 4 follows "2 3" 3 of 4 times, then 5 (2 of 3)
    assert store.lookup([50, 9], 2) == ([2, 3], 1)
    assert store.lookup([50, 51], 2) == ([], 0)
    store.save(tmp_path / "ngram", {"tokenizer_hash": "abc"})
    same = SimpleNamespace(tokenizer_hash=lambda: "abc", path="t")
    assert Datastore.load(tmp_path / "ngram", same).table == store.table
    with pytest.warns(UserWarning, match="tokenizer differs"):
        assert Datastore.load(tmp_path / "ngram", SimpleNamespace(tokenizer_hash=lambda: "xyz", path="t")) is None
    d = NgramDrafter(draft_len=2, datastore=store)
    assert d.draft([2, 3, 9, 9, 2, 3]) == ([9, 9], "ctx2")  # the context's own 2-gram wins
    assert d.draft([7, 0, 5, 2, 3]) == ([4, 5], "ds2")  # no context 2-gram: the datastore
    assert d.draft([44, 0, 44]) == ([0, 44], "ctx1")  # nothing in the datastore: a 1-gram copy


def test_ngram_context_index_matches_a_scan_of_the_whole_context():
    """The incremental index finds what scanning the context finds: the most recent earlier
    occurrence of the longest suffix n-gram, as the context grows a few tokens at a time."""
    from angelspec.drafters.ngram import ContextIndex

    def scan(tokens, k, max_n, min_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            for j in range(len(tokens) - n - 1, -1, -1):
                if tokens[j:j + n] == tokens[len(tokens) - n:]:
                    return tokens[j + n: j + n + k], n
        return [], 0

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens, index = torch.randint(0, 6, (3,), generator=g).tolist(), ContextIndex(3)
        while len(tokens) < 80:
            for max_n, min_n in ((3, 2), (1, 1), (3, 1)):
                assert index.lookup(tokens, 4, max_n, min_n) == scan(tokens, 4, max_n, min_n)
            tokens += torch.randint(0, 6, (int(torch.randint(1, 5, (), generator=g)),), generator=g).tolist()


def test_ngram_tree_offers_the_contexts_other_continuations():
    """branches=3: the usual draft first, then what followed the other recent matches of the
    context's suffix n-grams (longest first), merged where they share a prefix."""
    from angelspec.drafters import NgramDrafter
    from angelspec.runtime.request import RequestState

    tokens = [5, 6, 1, 2, 5, 6, 3, 4, 5, 6, 1, 9, 5, 6]
    s = RequestState(0, tokens, len(tokens), SamplingParams(), "ngram", None)
    chain = NgramDrafter(draft_len=2).propose([s.view("a")])[0]
    tree = NgramDrafter(draft_len=2, branches=3).propose([s.view("b")])[0]
    assert chain.tokens.tolist() == [1, 9] and chain.parents is None  # the latest match of "5 6"
    # then "5 6 3 4" and "5 6 1 2": 1 is shared with the first draft, so only 2 is new
    assert tree.tokens.tolist() == [1, 9, 3, 4, 2] and tree.parents.tolist() == [-1, 0, -1, 2, 0]
    assert tree.confidence[2] < tree.confidence[0]  # the others count half


def test_ngram_indexes_a_prompt_at_prefill_not_while_drafting(tiny):
    """A prompt's n-grams are indexed at prefill, so a step's drafting is the lookup and the
    last step's few tokens: counted into drafting, a long prompt's indexing (milliseconds on a
    2-core CPU) made the gate sit ngram out under load (16 in flight). Later tokens wait for the
    next draft, so a step where the gate sits ngram out costs it nothing."""
    from angelspec.drafters import NgramDrafter

    behind = []

    class Spy(NgramDrafter):
        def propose(self, states):
            behind.extend(len(s.tokens) - 1 - self.index(s).indexed for s in states)
            return super().propose(states)

    eng = Engine(tiny, max_batch=2, max_len=256, drafters={"spy": Spy(draft_len=3)})
    prompts = [list(range(3, 90)), [5, 6, 7, 5, 6, 7, 5, 6]]
    out = eng.generate([Request(p, SamplingParams(max_tokens=12), "spy") for p in prompts])
    ref = eng.generate([Request(p, SamplingParams(max_tokens=12), "none") for p in prompts])
    assert [r.tokens for r in out] == [r.tokens for r in ref]
    assert behind and max(behind) <= 3 + 1  # a step commits at most its draft and the bonus token


@pytest.mark.parametrize("kind", ["mtp", "dfly"])
def test_a_cached_prompt_prefix_changes_nothing(target8, tmp_path, kind):
    """Prompts that start with the engine's prompt prefix (a chat template's preamble) take its
    keys, values and hidden states from the cache instead of prefilling them: the same tokens, and
    the same drafts (the drafters saw the same features: the same drafted and accepted counts),
    as without the cache, packed or alone; a prompt that is the prefix, or that does not start
    with it, prefills whole."""
    cfg, model = draft(target8, kind, vocab=60)
    save_draft(tmp_path / cfg.kind, cfg, model.state_dict())
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(1, 96, (21,), generator=g).tolist()
    prompts = [prefix + torch.randint(1, 96, (n,), generator=g).tolist() for n in (1, 9, 60)]
    prompts += [prefix, prefix[:5] + [7, 8], prefix + [3]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    runs = []
    for batch, cached in ((3, None), (1, prefix), (3, prefix)):
        eng = Engine(target8, max_batch=batch, max_len=200, drafts=str(tmp_path), prompt_prefix=cached)
        out = eng.generate([Request(p, params, kind) for p in prompts])
        runs.append([(r.tokens, r.stats.drafted, r.stats.accepted) for r in out])
        assert eng.stats.prefix_hits == (4 if cached else 0)
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert sum(d for _, d, _ in runs[0]) > 0
    # the cache holds what a whole prefill writes, bit for bit
    caches = []
    for cached in (None, prefix):
        eng = Engine(target8, max_batch=1, max_len=200, prompt_prefix=cached)
        eng.generate([Request(prompts[2], SamplingParams(max_tokens=1))])
        caches.append(eng.cache)
    n = len(prompts[2])
    for layer in range(target8.config.num_layers):
        assert torch.equal(caches[0].keys(layer)[0, :, :, :n], caches[1].keys(layer)[0, :, :, :n])
        assert torch.equal(caches[0].v[layer][0, :, :n], caches[1].v[layer][0, :, :n])
