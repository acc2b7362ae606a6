"""Shared fixtures: tiny randomly initialised Llama-family checkpoints (fast, exact tests)."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from angelspec.checkpoint import Target, read_config, read_weights
from angelspec.default_target import DEFAULT_DIR
from angelspec.model import Llama

REPO = pathlib.Path(__file__).resolve().parents[1]


def run_on_each_isa(script: str) -> list[str]:
    """Run a script in fresh processes, on this CPU's native path and with AVX-512 turned off
    (ANGELSPEC_NO_AVX512), so both kernels are covered on one CPU; what each printed."""
    outs = []
    for env in ({}, {"ANGELSPEC_NO_AVX512": "1"}):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs.append(proc.stdout)
    return outs


def check_on_each_isa(script: str) -> None:
    """Run a kernel check (a script printing "ok") on each path (run_on_each_isa)."""
    assert all("ok" in out for out in run_on_each_isa(script))


def rerun_without_amx(test: str) -> None:
    """Run one test (a pytest node id) again in a fresh process with AMX tiles turned off
    (ANGELSPEC_NO_AMX), so a CPU with tiles also covers the bf16 path of CPUs without them."""
    import angelspec.plugins as ops

    if not ops.amx_available():
        pytest.skip("no AMX tiles on this CPU: the test itself ran the path of CPUs without them")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          capture_output=True, text=True, cwd=REPO, timeout=900,
                          env={**os.environ, "ANGELSPEC_NO_AMX": "1"})
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def make_checkpoint(path: pathlib.Path, arch: str = "llama", seed: int = 0, **overrides):
    """Write a tiny random Hugging Face checkpoint folder (config + safetensors) and return it."""
    import transformers

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-5, eos_token_id=96, bos_token_id=1, tie_word_embeddings=True)
    common.update(overrides)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**common)).eval()
    with torch.no_grad():  # larger weights than the init default: sharper, more varied logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(path), safe_serialization=True)
    if common["vocab_size"] == 97:
        add_char_tokenizer(path)
    return model


def add_char_tokenizer(path: pathlib.Path) -> None:
    """A character-level tokenizer for the 97-token tiny models: 0 <unk>, 1-95 the printable
    ASCII characters, 96 </s> (the eos). Makes a tiny folder a complete target (CLI, data step)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "</s>": 96}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


def tiny_target(path: pathlib.Path, **kw) -> Target:
    make_checkpoint(path, **kw)
    cfg = read_config(path)
    return Target(path=path, config=cfg, model=Llama(cfg, read_weights(path), max_len=512),
                  tokenizer=None)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Target:
    return tiny_target(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def default_target() -> Target:
    """The real default target (SmolLM2-135M-Instruct); `make test` converts it first."""
    from angelspec.checkpoint import load_target

    path = REPO / DEFAULT_DIR
    if not (path / "model.safetensors").exists():
        pytest.skip("default target not converted: run `make target`")
    return load_target(path, max_len=1024)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Expose each phase's report on the test item (fixtures that show logs on failure read it)."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
