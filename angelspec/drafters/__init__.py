"""Drafter registry. `none` (shown as `ar`) is plain autoregressive decoding; `ngram` needs no
training (it uses `<drafts>/ngram/`, the datastore of the target's own responses, when there is
one; `ngram:datastore=0` does without); `mtp`, `dfly` and `dflash` load a trained draft
(`<drafts>/<name>/`) for the target. Joined by `+` (`ngram+mtp`), drafters draft one hybrid tree."""
import pathlib
import re

from angelspec.drafters.base import Drafter, Proposal
from angelspec.drafters.dfly import DFlashDrafter, DFlyDrafter
from angelspec.drafters.hybrid import HybridDrafter
from angelspec.drafters.mtp import MTPDrafter
from angelspec.drafters.ngram import Datastore, NgramDrafter

ALIASES = {"ar": "none"}
DRAFTERS = {"none": Drafter, "ngram": NgramDrafter, "mtp": MTPDrafter, "dfly": DFlyDrafter,
            "dflash": DFlashDrafter}
TRAINED = ("mtp", "dfly", "dflash")
DEFAULT_DRAFTS = pathlib.Path("build/drafts")


# the options each drafter takes after "name:" (key=value, comma-separated), all integers, with
# their allowed range: the one check for the CLI, the Python API and the server alike
OPTIONS = {
    "none": {},
    "ngram": {"draft_len": (1, 32), "max_ngram": (1, 8), "min_ngram": (1, 8), "datastore": (0, 1),
              "branches": (1, 8)},
    **{kind: {"draft_len": (1, 32), "rescore_top_k": (0, 1024), "draft_vocab": (0, 0), "branches": (1, 8)}
       for kind in TRAINED},
}


def parse_spec(name: str) -> tuple[str, dict]:
    """"dfly:rescore_top_k=0,draft_vocab=0" -> ("dfly", {...}): a drafter with serving options
    (benchmarks compare variants side by side). An unknown name or option, or a value that is not
    an integer in the option's range, raises ValueError naming it."""
    if not isinstance(name, str):
        raise ValueError(f"drafter must be a string, got {type(name).__name__}")
    base, _, opts = name.partition(":")
    key = ALIASES.get(base, base)
    if key not in DRAFTERS:
        known = sorted(set(DRAFTERS) | set(ALIASES))
        raise ValueError(f"unknown drafter {base[:40]!r}; known drafters: {', '.join(known)}")
    allowed, options = OPTIONS[key], {}
    for item in opts.split(",") if opts else []:
        k, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"drafter {key}: option {item[:40]!r} must look like key=value")
        if k not in allowed:
            raise ValueError(f"drafter {key}: unknown option {k[:40]!r}; its options are "
                             + (", ".join(allowed) if allowed else "none"))
        lo, hi = allowed[k]
        if not re.fullmatch(r"-?[0-9]{1,9}", v) or not lo <= int(v) <= hi:
            raise ValueError(f"drafter {key}: option {k} must be an integer in [{lo}, {hi}], "
                             f"got {v[:40]!r}")
        if k in options:
            raise ValueError(f"drafter {key}: option {k} given twice")
        options[k] = int(v)
    return key, options


def parts(name: str) -> list[str]:
    """The drafters of a (hybrid) name: "ngram+mtp:branches=2" -> ["ngram", "mtp:branches=2"]."""
    if not isinstance(name, str):
        raise ValueError(f"drafter must be a string, got {type(name).__name__}")
    out = name.split("+")
    if len(out) > 1 and any(parse_spec(p)[0] == "none" for p in out):
        raise ValueError(f"drafter {name[:80]!r}: a hybrid joins drafters, not ar")
    if len(set(parse_spec(p)[0] for p in out)) < len(out):
        raise ValueError(f"drafter {name[:80]!r}: a hybrid joins different drafters")
    return out


def canonical(name: str) -> str:
    """Registry name of a user-facing drafter name (with its options, if any, in a fixed order)."""
    if len(parts(name)) > 1:
        return "+".join(canonical(p) for p in parts(name))
    key, options = parse_spec(name)
    return key + (":" + ",".join(f"{k}={options[k]}" for k in sorted(options)) if options else "")


def make_drafter(name: str, draft_len: int | dict | None = None, target=None,
                 drafts: str | pathlib.Path | None = None) -> Drafter:
    """Build a drafter; trained ones load `<drafts>/<name>/` and check it fits `target`.
    draft_len: tokens per step, or a dict of them per drafter kind (an engine's tuned lengths);
    a hybrid's parts each take their own."""
    if len(parts(name)) > 1:
        return HybridDrafter([make_drafter(p, draft_len, target, drafts) for p in parts(name)])
    key, options = parse_spec(name)
    if isinstance(draft_len, dict):
        draft_len = draft_len.get(key)
    if draft_len is not None:
        options.setdefault("draft_len", draft_len)
    cls = DRAFTERS[key]
    try:
        if key in TRAINED:
            if target is None:
                raise ValueError(f"the {key} drafter needs the target it was trained for")
            return cls(target, pathlib.Path(drafts or DEFAULT_DRAFTS) / key, **options)
        if key == "ngram" and options.pop("datastore", 1) and drafts is not None:
            folder = pathlib.Path(drafts) / "ngram"
            if (folder / Datastore.FILE).exists():
                options["datastore"] = Datastore.load(folder, target)
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"drafter {name!r}: unsupported option ({exc})") from exc


__all__ = ["ALIASES", "DEFAULT_DRAFTS", "Datastore", "Drafter", "Proposal", "NgramDrafter", "MTPDrafter",
           "DFlyDrafter", "DFlashDrafter", "HybridDrafter", "TRAINED", "canonical", "make_drafter",
           "parse_spec", "parts", "DRAFTERS", "OPTIONS"]
