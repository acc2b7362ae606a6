"""N-gram drafting: copy what followed the last earlier occurrence of the context's most recent
n-gram (prompt lookup: strong where outputs repeat their input, code edits, quotes), and, where the
context has no match of 2 tokens or more, what most often followed it in the target's own
responses to the training prompts (a datastore built from the data step: the phrasing a model
repeats from answer to answer). Neither needs a forward pass; the datastore is a dict lookup."""
from __future__ import annotations

import collections
import json
import pathlib
import warnings

import torch

from angelspec.drafters.base import Drafter, Proposal


class ContextIndex:
    """Prompt lookup over a growing token list: the latest `keep` starts of every 1..max_ngram-gram
    of the list without its last token (so a match is always followed by something to copy),
    updated with each call's new tokens. A request keeps one, so a lookup costs a few dict
    reads instead of a scan of its whole context every step."""

    def __init__(self, max_ngram: int = 3, keep: int = 4):
        self.max_ngram, self.keep = max_ngram, keep
        self.starts: dict[tuple, list[int]] = {}  # oldest first
        self.indexed = 0  # n-grams ending before this position are in `starts`

    def update(self, tokens: list[int]) -> None:
        for end in range(self.indexed + 1, len(tokens)):  # n-grams tokens[j:end], end < len
            for n in range(1, min(self.max_ngram, end) + 1):
                starts = self.starts.setdefault(tuple(tokens[end - n:end]), [])
                starts.append(end - n)
                if len(starts) > self.keep:
                    del starts[0]
        self.indexed = max(self.indexed, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int, max_ngram: int = 3,
               min_ngram: int = 1) -> tuple[list[int], int]:
        """Up to k tokens that followed the most recent earlier match of the longest suffix n-gram
        (min_ngram <= n <= max_ngram), and that n (0: no match)."""
        self.update(tokens)
        for n in range(min(max_ngram, self.max_ngram, len(tokens) - 1), min_ngram - 1, -1):
            starts = self.starts.get(tuple(tokens[len(tokens) - n:]))
            if starts:
                return tokens[starts[-1] + n: starts[-1] + n + k], n
        return [], 0

    def continuations(self, tokens: list[int], k: int) -> list[tuple[list[int], int]]:
        """Every continuation (up to k tokens) of the recent earlier matches of each suffix
        n-gram, longest n and latest match first, with its n."""
        self.update(tokens)
        out = []
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            for j in reversed(self.starts.get(tuple(tokens[len(tokens) - n:]), [])):
                out.append((tokens[j + n: j + n + k], n))
        return out


class Datastore:
    """Every n-gram (n = 1..max_ngram) of a set of token sequences -> the continuation (up to
    `width` tokens) that most often followed it, chosen token by token (the most frequent first
    token, then the most frequent second among the continuations that start with it, ...)."""
    FILE = "datastore.safetensors"

    def __init__(self, table: dict[tuple, list[int]], max_ngram: int):
        self.table, self.max_ngram = table, max_ngram

    @classmethod
    def build(cls, sequences, max_ngram: int = 4, width: int = 8, progress=None) -> "Datastore":
        seen: dict[tuple, collections.Counter] = {}
        for seq in sequences:
            for i in range(1, len(seq)):
                cont = tuple(seq[i:i + width])
                for n in range(1, min(max_ngram, i) + 1):
                    seen.setdefault(tuple(seq[i - n:i]), collections.Counter())[cont] += 1
            if progress:
                progress(len(seq))
        table = {}
        for key, conts in seen.items():
            best = []
            for d in range(width):
                firsts = collections.Counter()
                for cont, c in conts.items():
                    if len(cont) > d:
                        firsts[cont[d]] += c
                if not firsts:
                    break
                tok = firsts.most_common(1)[0][0]
                best.append(tok)
                conts = {cont: c for cont, c in conts.items() if len(cont) > d and cont[d] == tok}
            table[key] = best
        return cls(table, max_ngram)

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that most often followed the longest suffix n-gram found, and that n."""
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            hit = self.table.get(tuple(tokens[-n:]))
            if hit:
                return hit[:k], n
        return [], 0

    def save(self, folder: str | pathlib.Path, info: dict) -> None:
        """<folder>/datastore.safetensors (keys and continuations, -1 padded) + config.json."""
        from safetensors.torch import save_file

        folder = pathlib.Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        width = max((len(v) for v in self.table.values()), default=1)
        keys = torch.full((len(self.table), self.max_ngram), -1, dtype=torch.int32)
        conts = torch.full((len(self.table), width), -1, dtype=torch.int32)
        for i, (key, cont) in enumerate(self.table.items()):
            keys[i, :len(key)] = torch.tensor(key, dtype=torch.int32)
            conts[i, :len(cont)] = torch.tensor(cont, dtype=torch.int32)
        save_file({"keys": keys, "continuations": conts}, str(folder / self.FILE))
        (folder / "config.json").write_text(json.dumps(
            {"kind": "ngram", "max_ngram": self.max_ngram, "entries": len(self.table), **info}, indent=1))

    @staticmethod
    def fits(folder: str | pathlib.Path, target) -> bool:
        """Whether the datastore in `folder` was built with `target`'s tokenizer (or either hash
        is unknown): with another, its token ids would mean other words."""
        mine = json.loads((pathlib.Path(folder) / "config.json").read_text()).get("tokenizer_hash")
        theirs = target.tokenizer_hash() if target is not None else None
        return not (mine and theirs and mine != theirs)

    @classmethod
    def load(cls, folder: str | pathlib.Path, target=None) -> "Datastore | None":
        """The datastore in `folder`, or None (with a warning) if it does not fit `target`."""
        from safetensors.torch import load_file

        folder = pathlib.Path(folder)
        info = json.loads((folder / "config.json").read_text())
        if not cls.fits(folder, target):
            warnings.warn(f"{folder} was built from {info.get('target')}, whose tokenizer differs from "
                          f"{target.path}'s: ngram drafts from the context only", stacklevel=2)
            return None
        d = load_file(str(folder / cls.FILE))
        table = {}
        for key, cont in zip(d["keys"].tolist(), d["continuations"].tolist()):
            table[tuple(t for t in key if t >= 0)] = [t for t in cont if t >= 0]
        return cls(table, info["max_ngram"])


class NgramDrafter(Drafter):
    """Confidence: no logits here, so token k of a draft gets the request's running rate of
    acceptance at depth k given the k-1 before it were accepted, measured by scoring each draft
    against the tokens committed after it, and kept apart by the length n of the n-gram that
    matched and by where it matched (the context or the datastore). Copies come in runs: once
    the first token matches, the next ones usually do too, which one overall rate per token misses
    (D-cut's survival products would then cut the long matches). And a 3-gram match copies far
    better than a 1-gram one. The rate for (match, k) starts from the request's rate at depth k
    over all matches (worth 2 observations), which starts from 1/2 (Laplace).

    Order: a context match of 2 tokens or more, else the datastore's longest match, else a
    context 1-gram match. With branches > 1 the draft is a token tree: that draft, then up to
    branches - 1 other continuations (`alternatives`) at half their rates."""
    name = "ngram"

    def __init__(self, draft_len: int = 3, max_ngram: int = 3, min_ngram: int = 1,
                 datastore: Datastore | None = None, branches: int = 1):
        super().__init__(draft_len)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.datastore = datastore
        self.branches = branches

    def draft(self, tokens: list[int], index: ContextIndex | None = None) -> tuple[list[int], str]:
        """A draft and where it matched ("ctx<n>" or "ds<n>"; "" when nothing matched). `index`:
        the request's ContextIndex over `tokens` (default: a fresh one)."""
        index = index or ContextIndex(self.max_ngram)
        draft, n = index.lookup(tokens, self.draft_len, self.max_ngram, max(self.min_ngram, 2))
        if draft:
            return draft, f"ctx{n}"
        if self.datastore is not None:
            draft, n = self.datastore.lookup(tokens, self.draft_len)
            if draft:
                return draft, f"ds{n}"
        if self.min_ngram <= 1:
            draft, n = index.lookup(tokens, self.draft_len, 1, 1)
            if draft:
                return draft, "ctx1"
        return [], ""

    def alternatives(self, tokens: list[int], index: ContextIndex, first: list[int]) -> list[tuple[list[int], str]]:
        """Up to branches - 1 other continuations than `first`: the context's other recent
        matches (longest n-gram first), then the datastore's."""
        out, seen = [], {tuple(first)}
        found = [(c, f"ctx{n}") for c, n in index.continuations(tokens, self.draft_len) if n >= self.min_ngram]
        if self.datastore is not None:
            cont, n = self.datastore.lookup(tokens, self.draft_len)
            found.append((cont, f"ds{n}"))
        for cont, match in found:
            if cont and tuple(cont) not in seen and len(out) < self.branches - 1:
                seen.add(tuple(cont))
                out.append((cont, match))
        return out

    def propose(self, states: list) -> list[Proposal]:
        out = []
        for s in states:
            st = s.drafter_state
            # [reached, accepted] per depth k, over all matches ("all") and per kind of match
            seen_at = st.setdefault("seen", {})
            if "last" in st:  # score the previous draft against what was committed after it
                start, match, prev = st.pop("last")
                seen = s.tokens[start: start + len(prev)]
                m = 0
                while m < len(seen) and seen[m] == prev[m]:
                    m += 1
                for key in ("all", match):
                    rows = seen_at.setdefault(key, [])
                    for k in range(min(m + 1, len(seen))):
                        if k == len(rows):
                            rows.append([0, 0])
                        rows[k][0] += 1
                        rows[k][1] += k < m
            draft, match = self.draft(s.tokens, self.index(s))
            st["last"] = (len(s.tokens), match, draft)
            conf = self.confidence(seen_at, match, len(draft))
            if not draft or self.branches == 1:
                out.append(Proposal(torch.tensor(draft, dtype=torch.long), torch.tensor(conf)))
                continue
            # the others: half as likely as the first
            out.append(Proposal.tree([(draft, conf)] + [
                (cont, [c / 2 for c in self.confidence(seen_at, kind, len(cont))])
                for cont, kind in self.alternatives(s.tokens, self.index(s), draft)]))
        return out

    def index(self, state) -> ContextIndex:
        st = state.drafter_state
        if "index" not in st:
            st["index"] = ContextIndex(self.max_ngram)
        return st["index"]

    def on_commit(self, state, hidden: dict[int, torch.Tensor]) -> None:
        """Index the prompt at prefill: its hundreds of n-grams (milliseconds on a 2-core CPU) in
        its first step's drafting would read to the gate as what every step of ngram costs, and
        sit it out. Later tokens are indexed when it next drafts (a lookup catches up), so a step
        where the gate sits it out costs it nothing."""
        if "index" not in state.drafter_state:
            self.index(state).update(state.tokens)

    @staticmethod
    def confidence(seen_at: dict, match: str, k: int) -> list[float]:
        """Per depth of a draft that matched as `match`: the request's rate of acceptance there."""
        overall, mine = seen_at.get("all", []), seen_at.get(match, [])
        conf = []
        for d in range(k):
            prior = (overall[d][1] + 1) / (overall[d][0] + 2) if d < len(overall) else 0.5
            conf.append((mine[d][1] + 2 * prior) / (mine[d][0] + 2) if d < len(mine) else prior)
        return conf
