"""The one checkpoint reader: a Hugging Face style folder -> config, weights, tokenizer."""
from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from angelspec import DEFAULT_MAX_LEN
from angelspec.model import Llama, ModelConfig
from angelspec.text import encode_chat


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used, with a message that says why."""


@dataclass
class Target:
    path: pathlib.Path
    config: ModelConfig
    model: Llama
    tokenizer: object

    @property
    def eos_ids(self) -> list[int]:
        return self.config.eos_token_ids

    def encode_chat(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of a user prompt, wrapped in the chat template when there is one; special
        tokens written in the prompt stay text (angelspec.text)."""
        return encode_chat(self.tokenizer, prompt, chat)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prefix(self) -> list[int]:
        """The tokens every chat-templated prompt starts with (a system preamble: 24 tokens for
        SmolLM2-Instruct), [] without a tokenizer or chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            return []
        a, b = self.encode_chat("Hello"), self.encode_chat("2 + 2 = ?")
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return a[:n]

    def tokenizer_hash(self) -> str:
        """SHA-256 of tokenizer.json: the vocabulary drafts and datastores must share (a draft's
        own config checks the rest of what it needs: hidden size, layers)."""
        f = self.path / "tokenizer.json"
        return hashlib.sha256(f.read_bytes()).hexdigest() if f.exists() else ""

    def model_hash(self) -> str:
        """SHA-256 of config.json + tokenizer.json: what training data depends on (its responses
        and cached hidden states come from this model)."""
        h = hashlib.sha256()
        for name in ("config.json", "tokenizer.json"):
            f = pathlib.Path(self.path) / name
            h.update(f.read_bytes() if f.exists() else b"")
        return h.hexdigest()


def read_config(path: str | pathlib.Path) -> ModelConfig:
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"target checkpoint folder not found: {path} "
                              "(run `make target` for the default model, or pass a Hugging Face "
                              "checkpoint folder)")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
    try:
        return ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file}: {exc}") from exc


def read_weights(path: pathlib.Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights (pickled .bin checkpoints are "
                              "not loaded: convert them with save_pretrained(safe_serialization=True))")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def load_target(path: str | pathlib.Path, max_len: int = DEFAULT_MAX_LEN) -> Target:
    """Load a Llama-family target: our lean model for decoding, transformers' tokenizer."""
    from transformers import AutoTokenizer

    path = pathlib.Path(path)
    cfg = read_config(path)
    try:
        model = Llama(cfg, read_weights(path), max_len=min(max_len, cfg.max_position_embeddings))
    except KeyError as exc:
        raise CheckpointError(f"{path}: weight {exc} missing for a {cfg.architecture}") from exc
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise CheckpointError(f"{path}: tokenizer could not be loaded: {exc}") from exc
    if not cfg.eos_token_ids and tok.eos_token_id is not None:
        cfg.eos_token_ids = [tok.eos_token_id]
    return Target(path=path, config=cfg, model=model, tokenizer=tok)
