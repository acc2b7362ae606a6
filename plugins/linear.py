"""y = x @ w.T for the target's weight matrices, with row-count-independent numerics.

Float32 weights, up to SKINNY_MAX_ROWS rows (decoding and verification forwards), use
`angelspec::skinny_linear`: weights are streamed once for all rows, and each row rounds exactly
as it would alone, so a k-token verification forward gives bit-identical logits to k one-token
forwards. Longer inputs (prompt prefill) are compute-bound and go to the BLAS routine.

Weights packed by `pack_bf16` (bf16, any row count) use `angelspec::amx_linear` on the AMX tile
unit, row-exact too. On CPUs without the tiles, bf16 weights stay in rows (`Bf16Weight`, in
chunks laid out for a shuffle-free load) and `skinny_linear` widens each one to float32 as it
loads it: the float32 kernel's result on those weight values, bit for bit, at half the bytes read.

Weight-only quantized weights (`quantize`: int8 or int4 in groups of 32) use
`angelspec::quant_linear` up to SKINNY_MAX_ROWS rows: it expands each block of weight rows to
float32 in cache and runs the skinny kernel's tiles on it, so it computes exactly what the
float32 path does on the dequantized weights (`QuantWeight.dequantized`), which longer inputs
use (as they use a Bf16Weight's). The w8a8 / w4a8 schemes keep those weights and round the
activations to int8 in blocks of 32 as llama.cpp does (`angelspec::quant_dot_linear`: integer
dot products, row-exact, any row count): fewer instructions per weight, at the cost of the
activations' rounding.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from angelspec.plugins.build import load_kernels

SKINNY_MAX_ROWS = 128

load_kernels()
_skinny = torch.ops.angelspec.skinny_linear
_amx = torch.ops.angelspec.amx_linear
_quant = torch.ops.angelspec.quant_linear
_quant_dot = torch.ops.angelspec.quant_dot_linear


def amx_available() -> bool:
    """This CPU has AMX-BF16 tiles and Linux lets this process use them."""
    return bool(torch.ops.angelspec.amx_available())


def can_pack(w: torch.Tensor) -> bool:
    """Whether `pack_bf16` takes this weight: [out, in] with out % 16 == 0 and in % 32 == 0."""
    return w.dim() == 2 and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] -> its bf16 values (round to nearest even) in the AMX tile layout, same
    shape; `linear` recognises the result by its dtype."""
    return torch.ops.angelspec.amx_pack(w.float().contiguous())


CHUNK = 32  # inputs per chunk of a Bf16Weight row


@dataclass(frozen=True)
class Bf16Weight:
    """bf16 weights [out, in] as CPUs without AMX tiles serve them: the float32 kernels multiply
    them (each weight widened exactly), so they compute the float32 model on these weight values,
    with activations in float32 (AMX tiles round those to bf16: the two kinds of machine give
    slightly different outputs for the same engine). Each row lies in chunks of CHUNK inputs, each
    chunk as pairs (input j, input 16 + j), so that one 64-byte load widens to float32 in input
    order without a shuffle (csrc/skinny_tile.h); the last in % CHUNK inputs in order."""
    w: torch.Tensor  # bfloat16 [out, in], chunked rows: build with Bf16Weight.of

    @staticmethod
    def of(w: torch.Tensor) -> "Bf16Weight":
        """From [out, in] weights in input order (float32 ones rounded to nearest even)."""
        w = w.bfloat16()
        out, body = w.shape[0], w.shape[1] - w.shape[1] % CHUNK
        chunks = w[:, :body].reshape(out, -1, 2, CHUNK // 2).transpose(2, 3).reshape(out, body)
        return Bf16Weight(torch.cat([chunks, w[:, body:]], 1).contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def dequantized(self) -> torch.Tensor:
        """The float32 weights this serves, in input order."""
        out, body = self.w.shape[0], self.w.shape[1] - self.w.shape[1] % CHUNK
        rows = self.w[:, :body].reshape(out, -1, CHUNK // 2, 2).transpose(2, 3).reshape(out, body)
        return torch.cat([rows, self.w[:, body:]], 1).float()


GROUP = 32  # input weights per scale (and offset): llama.cpp's Q8_0 / Q4_1 blocks
WITH_INT8_ACTIVATIONS = {"int8": "w8a8", "int4": "w4a8"}  # the same weights, llama.cpp's arithmetic
SCHEMES = (*WITH_INT8_ACTIVATIONS, *WITH_INT8_ACTIVATIONS.values())
WEIGHT_BITS = {"int8": 8, "int4": 4, "w8a8": 8, "w4a8": 4}


@dataclass(frozen=True)
class QuantWeight:
    """A weight-only quantized [out, in] matrix, in groups of GROUP input weights.

    int8: w = q * scale (q int8 [out, in] in [-127, 127], symmetric: llama.cpp's Q8_0).
    int4: w = q * scale + offset (q uint8 [out, in / 2], levels 0-15 from the group's minimum,
    two a byte as csrc/quant_tile.h lays them out: llama.cpp's Q4_1). A checkpoint converted from
    such a GGUF (the default target's is Q4_1 with a Q8_0 embedding) comes back exactly.
    int8_activations (w8a8 / w4a8): `linear` rounds x to int8 in blocks of GROUP first, and the
    scales and minima are float16, as in the GGUF blocks (a float32 one is rounded to float16
    before the weights are rounded to its levels): a sixth fewer bytes per int4 weight. q, scale
    and offset then keep their shapes but lie in tiles of TILE rows (`tile_for_dot`)."""
    q: torch.Tensor
    scale: torch.Tensor  # float32 [out, in // GROUP] (float16 with int8_activations)
    bits: int
    offset: torch.Tensor | None = None  # like scale (int4)
    int8_activations: bool = False

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.q.shape[0], self.q.shape[1] * (8 // self.bits)])

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offset is None else self.offset.nbytes
        return self.q.nbytes + self.scale.nbytes + extra

    def dequantized(self) -> torch.Tensor:
        """The float32 weights this serves: q * scale (+ offset), each operation rounded, as the
        kernel computes them."""
        out, cols = self.shape
        q, scale, offset = (untile_for_dot(self) if self.int8_activations
                            else (self.q, self.scale, self.offset))
        if self.bits == 8:
            q = q.float()
        else:
            b = q.view(out, -1, 1, 16)
            q = torch.cat([b & 15, b >> 4], dim=2).view(out, cols).float()
        w = q.view(out, -1, GROUP) * scale.float()[..., None]
        if offset is not None:
            w = w + offset.float()[..., None]
        return w.view(out, cols)


TILE = 16  # rows per tile of the w8a8 / w4a8 layout


def tile_for_dot(levels: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Levels [out, in] (int8, or int4's 0-15 as uint8), scales and minima [out, in / GROUP] ->
    the layout of the integer dot kernel (csrc/dot_tile.h), same shapes as the plain layout: for
    each tile of TILE rows and each block of GROUP inputs, the 16 rows' scales (and minima), and
    the weights in groups of 4 consecutive inputs times the 16 rows (int4: a byte holds input k in
    its low nibble and k + 16 in its high one)."""
    out, cols = levels.shape
    t, b = out // TILE, cols // GROUP
    per_tile = lambda v: v.view(t, TILE, b).transpose(1, 2).reshape(out, b).contiguous()  # noqa: E731
    if bits == 8:
        q = levels.view(t, TILE, b, 8, 4).permute(0, 2, 3, 1, 4).reshape(out, cols)
    else:  # (tile, row, block, half, group, input) -> (tile, block, group, row, input, half)
        u = levels.view(t, TILE, b, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
        q = (u[..., 0] | (u[..., 1] << 4)).reshape(out, cols // 2)
    return q.contiguous(), per_tile(scale), None if offset is None else per_tile(offset)


def untile_for_dot(w: "QuantWeight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A w8a8 / w4a8 weight's q, scale and offset in the plain layout (`quantize`'s)."""
    out, cols = w.shape
    t, b = out // TILE, cols // GROUP
    per_row = lambda v: v.view(t, b, TILE).transpose(1, 2).reshape(out, b)  # noqa: E731
    if w.bits == 8:
        q = w.q.view(t, b, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(out, cols)
    else:  # (tile, block, group, row, input, half) -> (tile, row, block, half, group, input)
        v = w.q.view(t, b, 4, TILE, 4)
        u = torch.stack([v & 15, v >> 4], dim=-1).permute(0, 3, 1, 5, 2, 4).reshape(out, b, 2, 16)
        q = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(out, cols // 2)
    return q, per_row(w.scale), None if w.offset is None else per_row(w.offset)


def can_quantize(w: torch.Tensor) -> bool:
    """Whether `quantize` takes this weight: 2-D, rows of a multiple of GROUP weights."""
    return w.dim() == 2 and w.shape[1] % GROUP == 0


def quantize(w: torch.Tensor, scheme: str) -> QuantWeight:
    """float32 [out, in] -> QuantWeight, rounding each weight to the nearest level of its group:
    int8 / w8a8, scale = max |w| / 127; int4 / w4a8, offset = min w and scale = (max w - min w)
    / 15."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown weight scheme {scheme!r} ({', '.join(SCHEMES)})")
    if not can_quantize(w):
        raise ValueError(f"{scheme}: rows of a multiple of {GROUP} weights expected, got {tuple(w.shape)}")
    out, cols = w.shape
    a8 = scheme in WITH_INT8_ACTIVATIONS.values()
    if a8 and out % TILE:  # the integer dot kernel takes tiles of TILE rows: weight-only instead
        return quantize(w, {v: k for k, v in WITH_INT8_ACTIVATIONS.items()}[scheme])
    g = w.float().reshape(out, -1, GROUP)
    # a8: float16 scales and minima, rounded before the weights are rounded to their levels
    dtype = torch.float16 if a8 else torch.float32
    tiny = 2.0 ** -24 if a8 else torch.finfo(torch.float32).tiny  # the smallest usable scale
    stored = lambda t: t.to(dtype).float()  # noqa: E731
    if WEIGHT_BITS[scheme] == 8:
        scale = stored((g.abs().amax(2) / 127).clamp_min(tiny))
        q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).view(out, cols)
        if a8:
            return QuantWeight(*tile_for_dot(q, scale.to(dtype), None, 8)[:2], 8, int8_activations=True)
        return QuantWeight(q.contiguous(), scale.contiguous(), 8)
    low = stored(g.amin(2))
    scale = stored(((g.amax(2) - low) / 15).clamp_min(tiny))
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    if a8:
        q, s, m = tile_for_dot(q.view(out, cols), scale.to(dtype), low.to(dtype), 4)
        return QuantWeight(q, s, 4, m, True)
    u = q.view(out, -1, 2, 16)
    return QuantWeight((u[:, :, 0] | (u[:, :, 1] << 4)).reshape(out, -1).contiguous(),
                       scale.contiguous(), 4, low.contiguous())


def served(w: torch.Tensor, weights: str, logits: bool = False):
    """A float32 [out, in] matrix as an engine serving `weights` multiplies it: bf16 (packed for
    the AMX tiles where the CPU has them, else a Bf16Weight), quantized by the scheme (a logits
    matrix by its 8-bit variant, as llama.cpp keeps its output matrix), or w itself (float32, or
    a shape the format does not take)."""
    if weights == "bfloat16":
        if not amx_available():
            return Bf16Weight.of(w) if w.dim() == 2 else w
        return pack_bf16(w) if can_pack(w) else w
    if weights in SCHEMES:
        if logits:
            weights = WITH_INT8_ACTIVATIONS["int8"] if weights in WITH_INT8_ACTIVATIONS.values() else "int8"
        return quantize(w, weights) if can_quantize(w) else w
    return w


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in], w [out, in] (float32, packed by pack_bf16, a Bf16Weight or a QuantWeight),
    b [out] or None -> [..., out]."""
    if type(w) is QuantWeight and w.int8_activations and not x.requires_grad:
        # the decoding step's hot path (121 calls a step for the default target): no more
        # Python than it needs
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        y = _quant_dot(flat if flat.dtype == torch.float32 else flat.float(), w.q, w.scale, w.offset, w.bits)
        if flat is not x:
            y = y.view(*x.shape[:-1], y.shape[-1])
        return y if b is None else y + b
    rows = x.numel() // x.shape[-1]
    if isinstance(w, (QuantWeight, Bf16Weight)):
        if rows > SKINNY_MAX_ROWS or x.requires_grad:  # prompt prefill: BLAS on the same weights
            return F.linear(x.float(), w.dequantized(), b)
        flat = x.reshape(rows, x.shape[-1]).float()
        y = _skinny(flat, w.w) if type(w) is Bf16Weight else _quant(flat, w.q, w.scale, w.offset, w.bits)
        y = y.reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    if w.dtype == torch.bfloat16:
        y = _amx(x.reshape(rows, x.shape[-1]).float(), w).reshape(*x.shape[:-1], w.shape[0])
        return y if b is None else y + b
    if (rows > SKINNY_MAX_ROWS or x.dtype != torch.float32 or x.requires_grad or w.requires_grad
            or not x.is_cpu):  # off the CPU: the reference ops inside a TensorRT plugin, on a GPU
        return F.linear(x, w, b)
    y = _skinny(x.reshape(rows, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b
