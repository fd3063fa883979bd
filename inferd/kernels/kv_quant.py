"""8-bit KV: the layout and the arithmetic that every attention backend shares (the spec: the
reference gathers through `dequantize`, the CPU and CUDA kernels do the same per element).

A layer's K (and likewise V) in 8 bits is two tensors over the same blocks:

    data       [num_blocks, block_size, kv_heads, head_dim]   float8 (e4m3fn or e5m2)
    exponents  [num_blocks, block_size, kv_heads]             int8: the row's scale is 2**exponent

Each (token, KV head) row has its own scale: the least power of two 2**e with max|x| <= 2**e *
the format's largest finite value, so the row's largest code lies in [largest / 2, largest] and
nothing overflows; the codes are x / 2**e rounded to nearest even. Why this granularity
(bench/RESULTS.md, issue 43, measured it against a per-layer scale and none):
- a power of two scales exactly both ways: only the 8-bit rounding loses anything;
- one byte a row: head size 64 takes 65 bytes against bfloat16's 128 (1.97x the tokens);
- a row is written once and its bits depend on no other row: batch-invariant.

    value = float(code) * 2**exponent      exact in float32, and in bfloat16 (e4m3's 3 and e5m2's
                                            2 mantissa bits fit bfloat16's 7)

The exponent needs no division (kernels must get the same one): with max|x| = m * 2**k,
m in [0.5, 1) (frexp) and the format's largest value 0.875 * 2**B (B = 9 for e4m3, 16 for
e5m2), e = k - B if m <= 0.875, else k - B + 1; clamped to [-127, 127]; an all-zero row gets
EXPONENT_OF_ZERO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# vLLM's names for --kv-cache-dtype, and what each stores: (torch dtype, B: the largest finite
# value is 0.875 * 2**B)
FORMATS: dict[str, tuple[torch.dtype, int]] = {
    "fp8_e4m3": (torch.float8_e4m3fn, 9),  # 448
    "fp8_e5m2": (torch.float8_e5m2, 16),  # 57344
}
ALIASES = {"fp8": "fp8_e4m3"}
KV_CACHE_DTYPES = ("auto", "fp8", *FORMATS)  # "auto": the model's dtype (no quantization)
EXPONENT_OF_ZERO = -127
MIN_EXPONENT, MAX_EXPONENT = -127, 127


def kv_format(kv_cache_dtype: str) -> str | None:
    """The 8-bit format a `kv_cache_dtype` setting names (None: "auto", the model's dtype)."""
    if kv_cache_dtype == "auto":
        return None
    name = ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name not in FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return name


@dataclass(frozen=True)
class QuantizedCache:
    """One layer's K (or V) in 8 bits: what a backend gets where it would get a plain cache tensor."""

    data: Tensor  # [num_blocks, block_size, kv_heads, head_dim] float8
    exponents: Tensor  # [num_blocks, block_size, kv_heads] int8

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def format(self) -> str:
        return next(name for name, (dtype, _) in FORMATS.items() if dtype == self.data.dtype)


def exponents_for(x: Tensor, fmt: str) -> Tensor:  # x [..., head_dim] -> [...] int8
    """Each row's scale exponent (the module's docstring: no division, exact)."""
    _, top = FORMATS[fmt]
    amax = x.float().abs().amax(-1)
    mantissa, k = torch.frexp(amax)
    e = k - top + (mantissa > 0.875).to(k.dtype)
    e = torch.where(amax > 0, e, torch.full_like(e, EXPONENT_OF_ZERO))
    return e.clamp(MIN_EXPONENT, MAX_EXPONENT).to(torch.int8)


def quantize(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:  # x [..., head_dim]
    """(codes [..., head_dim] float8, exponents [...] int8): x / 2**e rounded to nearest even."""
    exponents = exponents_for(x, fmt)
    scaled = torch.ldexp(x.float(), -exponents.to(torch.int32)[..., None])
    return scaled.to(FORMATS[fmt][0]), exponents


def dequantize(codes: Tensor, exponents: Tensor, dtype: torch.dtype) -> Tensor:
    """float(code) * 2**exponent in `dtype` (exact in float32 and bfloat16)."""
    return torch.ldexp(codes.float(), exponents.to(torch.int32)[..., None]).to(dtype)


def write(key: Tensor, value: Tensor, key_cache: QuantizedCache, value_cache: QuantizedCache,
          slot_mapping: Tensor) -> None:
    """Quantize each token's K and V rows ([T, kv_heads, head_dim]) into its cache slot (the
    8-bit `reshape_and_cache`'s spec)."""
    for x, cache in ((key, key_cache), (value, value_cache)):
        codes, exponents = quantize(x, cache.format)
        data = cache.data.view(torch.uint8).view(-1, *cache.data.shape[2:])  # (float8 has no index_copy_)
        data.index_copy_(0, slot_mapping, codes.view(torch.uint8))
        cache.exponents.view(-1, cache.exponents.shape[2]).index_copy_(0, slot_mapping, exponents)


def gather(cache: QuantizedCache, flat_slots: Tensor, dtype: torch.dtype) -> Tensor:  # -> [len, kv_heads, head_dim]
    """The rows at `flat_slots` of the flattened cache, dequantized to `dtype`."""
    data = cache.data.view(torch.uint8).view(-1, *cache.data.shape[2:]).index_select(0, flat_slots)
    exponents = cache.exponents.view(-1, cache.exponents.shape[2]).index_select(0, flat_slots)
    return dequantize(data.view(cache.data.dtype), exponents, dtype)
