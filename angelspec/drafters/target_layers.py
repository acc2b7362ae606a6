"""Which target hidden states the trained drafters read (Hugging Face indices: i = output of
decoder layer i, num_layers = the last hidden state before the final norm)."""
from __future__ import annotations


def dfly_layers(num_layers: int, k: int = 5) -> list[int]:
    """K evenly spaced layers from 1 to L-3, rounded (36 layers -> [1, 9, 17, 25, 33]); fewer,
    distinct ones on a target with under 8 layers."""
    last = max(num_layers - 3, 1)
    if k == 1:
        return [last]
    picks = [round(1 + (last - 1) * j / (k - 1)) for j in range(k)]
    return sorted(set(picks))


def mtp_layers(num_layers: int, k: int = 1) -> list[int]:
    """MTP's: the last hidden state, and with k > 1 also k - 1 of dfly_layers' picks (low, middle
    and high ones: EAGLE-3's fused features), all of them layers the data step caches."""
    return sorted(set(dfly_layers(num_layers, k - 1)) | {num_layers}) if k > 1 else [num_layers]


def training_layers(num_layers: int) -> list[int]:
    """Every layer any trained drafter reads: what the data step caches per token."""
    return sorted(set(dfly_layers(num_layers)) | set(mtp_layers(num_layers)))
