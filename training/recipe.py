"""Training recipes: YAML files in training/recipes (a recipe may `inherit` another and offer
`presets`), read into one typed Recipe. An unknown key, in a file or in a `--set`, fails with the
list of known ones; a value of the wrong type or out of its range fails with the key named."""
from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field

import yaml

from angelspec.prompts import DOMAINS

RECIPES = pathlib.Path(__file__).with_name("recipes")
KINDS = ("mtp", "dfly", "dflash", "ngram")


@dataclass
class Recipe:
    kind: str  # mtp, dfly, dflash (trained drafts) or ngram (a datastore, no gradient steps)
    data: str = "build/data"  # output of `angelspec data`
    out: str = "build/drafts/draft"
    domains: list[str] = field(default_factory=lambda: list(DOMAINS))
    # the draft
    draft_vocab: int = 8192  # most frequent response tokens; 0 = the target's full vocabulary
    draft_len: int = 3  # mtp: tokens drafted per step when served
    ttt_steps: int = 4  # mtp: rollout steps
    feature_layers: int = 1  # mtp: target layers read (1: the last; k: k - 1 more, EAGLE-3 style)
    num_layers: int = 2  # dfly/dflash: draft decoder layers
    block_size: int = 8  # dfly/dflash: B (B-1 tokens drafted per step)
    hybrid: bool = True  # dfly: per-layer mixture of target layers
    prior_sharpness: float = 2.0
    ar_head: bool = True  # dfly: predecessor-conditioned AR head
    anchors: int = 48  # dfly/dflash: blocks per sequence in one forward
    gamma: float = 4.0  # dfly/dflash: CE position decay exp(-(k-1)/gamma)
    tv_fraction: float = 0.0  # dfly/dflash: last part of training on the end-to-end TV loss
    labels: str = "hard"  # soft: the target's distribution over the draft vocabulary; hard: its token
    prompt_labels: bool = False  # prompt positions past the system preamble teach too
    ar_own: float = 0.0  # dfly: share of blocks whose AR head reads its own chain (ramped up from 0)
    init_from_target: bool = False  # start from the target's last decoder layer(s)
    # optimisation
    batch_size: int = 4  # sequences per optimizer step (per process)
    max_seq_len: int = 512
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 20
    grad_clip: float = 1.0
    steps: int = 300  # optimizer steps (0: no limit, with a time budget)
    minutes: float = 0.0  # a time budget (evaluations included): stop at `steps` or this, sooner; 0: none
    eval_every: int = 50
    save_every: int = 50
    val_sequences: int = 240  # held out of training for the accept-length estimate
    train_sequences: int = 0  # train on only this many of the rest (the data-vs-steps trade); 0: all
    outside_data: str = ""  # a data folder of prompts from other sources, walked at every evaluation too
    seed: int = 0
    threads: int = 0  # torch threads; 0 = torch's default
    autocast: str = "auto"  # bf16 autocast of training steps: auto (with AMX-BF16), bf16, none
    # ngram
    max_ngram: int = 4  # longest n-gram looked up in the datastore
    width: int = 8  # continuation tokens stored per n-gram

    def __post_init__(self):
        checks = [
            (self.kind in KINDS, f"kind {self.kind!r}: one of {', '.join(KINDS)}"),
            (bool(self.domains) and set(self.domains) <= set(DOMAINS),
             f"domains {self.domains}: a non-empty subset of {', '.join(DOMAINS)}"),
            (self.autocast in ("auto", "bf16", "none"), f"autocast {self.autocast!r}: auto, bf16 or none"),
            (0.0 <= self.tv_fraction <= 1.0, f"tv_fraction {self.tv_fraction}: between 0 and 1"),
            (0.0 <= self.ar_own <= 1.0, f"ar_own {self.ar_own}: between 0 and 1"),
            (self.minutes >= 0, f"minutes {self.minutes}: 0 (no time budget) or more"),
            (self.steps >= 0 and (self.steps or self.minutes), f"steps {self.steps}: positive, or 0 (no "
             "step limit) with a time budget in minutes"),
            (self.train_sequences >= 0, f"train_sequences {self.train_sequences}: 0 (all) or more"),
            (self.labels in ("soft", "hard"), f"labels {self.labels!r}: soft or hard"),
            (self.block_size >= 2, f"block_size {self.block_size}: at least 2"),
        ] + [(getattr(self, k) > 0, f"{k} {getattr(self, k)}: must be positive")
             for k in ("draft_len", "ttt_steps", "feature_layers", "num_layers", "anchors", "batch_size", "max_seq_len",
                       "lr", "eval_every", "save_every", "max_ngram", "width")]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ValueError("recipe: " + "; ".join(bad))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, where: str = "recipe") -> "Recipe":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; the keys are "
                             + ", ".join(sorted(fields)))
        hints = {"int": int, "float": (int, float), "bool": bool, "str": str, "list[str]": list}
        for key, value in raw.items():
            want = hints[fields[key].type]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise ValueError(f"{where}: {key} must be {fields[key].type}, got {value!r}")
        return cls(**{k: float(v) if fields[k].type == "float" else v for k, v in raw.items()})


def parse_value(text: str):
    """A YAML value; numbers like 5e-4 (a string to YAML 1.1) become floats."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def read_recipe(name: str) -> dict:
    """A recipe's YAML (name in training/recipes or a path), its `inherit` base merged in."""
    path = pathlib.Path(name)
    if not path.suffix:
        path = RECIPES / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
        raise ValueError(f"unknown recipe {name!r}: known recipes are {known}, or a YAML path")
    raw = yaml.safe_load(path.read_text())
    if "inherit" in raw:
        base = read_recipe(raw.pop("inherit"))
        presets = {**base.pop("presets", {}), **raw.pop("presets", {})}
        raw = {**base, **raw, "presets": presets}
    return raw


def load_recipe(name: str, preset: str | None = None, overrides: list[str] = ()) -> Recipe:
    """A recipe with its preset and key=value overrides applied."""
    raw = read_recipe(name)
    presets = raw.pop("presets", {})
    if preset:
        if preset not in presets:
            raise ValueError(f"recipe {name} has no preset {preset!r} (has: {', '.join(presets)})")
        raw.update(presets[preset])
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        raw[key] = parse_value(value)
    return Recipe.from_dict(raw, f"recipe {name}")
