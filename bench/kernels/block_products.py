"""The block products (inferd/kernels/cpu/csrc/cpu_matmul.cpp) on 4-bit weights, their activations
quantized to 8 bits per block against 16 (split into two bytes: two VNNI sums), in the same
process: one call of each of the default model's layer shapes, at a few row counts; each the
median call over ~0.3 s (decode_attention.timed).

    .venv/bin/python bench/kernels/block_products.py [--rows 1 8 32]
"""
from __future__ import annotations

import argparse

import torch
from decode_attention import timed  # (bench/ is this script's folder)

from inferd.kernels import cpu
from inferd.model.layers import linear, quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # [N, K]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    assert cpu.block_matmul_available(), "the block products need AVX-512 VNNI and the kernels built"
    torch.manual_seed(0)
    print("| layer [N x K] | rows | 8-bit activations µs | 16-bit µs | 16 / 8 |")
    print("|---|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        weight = quant.quantize_int4(torch.randn(n, k) * 0.05)
        layers = {bits: linear.BlockLinear(weight.codes, weight.scale, weight.minimum, None, bits) for bits in (8, 16)}
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            us = {bits: timed(lambda: layer(x)) * 1e6 for bits, layer in layers.items()}
            print(f"| {name} [{n} x {k}] | {rows} | {us[8]:.1f} | {us[16]:.1f} | {us[16] / us[8]:.2f}x |")


if __name__ == "__main__":
    main()
