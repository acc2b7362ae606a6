"""A trained draft on disk: `config.json` (kind, the target it belongs to, shapes) and
`model.safetensors` (its own weights and draft vocabulary; the target's frozen parts are not
copied). Loading checks that the draft belongs to the target it is served with."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from angelspec.checkpoint import CheckpointError

FORMAT = 1
KINDS = ("mtp", "dfly", "dflash")


@dataclass
class DraftConfig:
    kind: str
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    target_num_layers: int
    target_layers: list[int]  # target hidden states read (Hugging Face indices)
    num_layers: int = 1  # draft decoder layers
    draft_len: int = 3  # tokens proposed per step (block size - 1 for dfly/dflash)
    block_size: int = 8
    hybrid: bool = False  # DFly: per-layer softmax mixture of target layers
    ar_head: bool = False  # DFly: predecessor-conditioned AR head
    rescore_top_k: int = 0  # AR head chain: re-score only the backbone's top-k (0 = off)
    prior_sharpness: float = 2.0
    draft_vocab: int = 0  # size of the draft vocabulary (0 = the full target vocabulary)
    target: str = ""
    tokenizer_hash: str = ""
    trained_steps: int = 0
    format: int = FORMAT
    notes: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, target, kind: str, **kw) -> "DraftConfig":
        c = target.config
        return cls(kind=kind, hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                   num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                   intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
                   target_num_layers=c.num_layers, target=str(target.path),
                   tokenizer_hash=target.tokenizer_hash(), **kw)

    def check(self, target) -> None:
        """Raise CheckpointError naming every way this draft does not fit `target`."""
        c = target.config
        problems = [f"{name}: draft {mine}, target {theirs}" for name, mine, theirs in (
            ("hidden size", self.hidden_size, c.hidden_size),
            ("vocabulary size", self.vocab_size, c.vocab_size),
            ("target layers", self.target_num_layers, c.num_layers),
            ("attention heads", (self.num_heads, self.num_kv_heads, self.head_dim),
             (c.num_heads, c.num_kv_heads, c.head_dim)),
        ) if mine != theirs]
        if max(self.target_layers, default=0) > c.num_layers:
            problems.append(f"layer ids {self.target_layers} beyond the target's {c.num_layers}")
        theirs = target.tokenizer_hash()
        if self.tokenizer_hash and theirs and self.tokenizer_hash != theirs:
            problems.append("tokenizer differs (tokenizer.json hash)")
        if problems:
            raise CheckpointError(f"{self.kind} draft trained for {self.target or 'another target'}"
                                  f" does not match target {target.path}: " + "; ".join(problems))


def save_draft(path: str | pathlib.Path, cfg: DraftConfig, state: dict[str, torch.Tensor]) -> None:
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp))
    tmp.replace(path / "model.safetensors")  # config last: a folder with a config is complete
    (path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")


def load_draft(path: str | pathlib.Path, target=None) -> tuple[DraftConfig, dict]:
    path = pathlib.Path(path)
    cfg_file, weights = path / "config.json", path / "model.safetensors"
    if not cfg_file.exists() or not weights.exists():
        raise CheckpointError(f"no trained draft in {path} (config.json and model.safetensors "
                              "expected): run `make drafts` or `angelspec train --recipe ...`")
    raw = json.loads(cfg_file.read_text())
    if raw.get("kind") not in KINDS:
        raise CheckpointError(f"{cfg_file}: unknown draft kind {raw.get('kind')!r}")
    known = {f.name for f in dataclasses.fields(DraftConfig)}
    cfg = DraftConfig(**{k: v for k, v in raw.items() if k in known})
    if target is not None:
        cfg.check(target)
    return cfg, load_file(str(weights))
