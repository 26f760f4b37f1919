"""What this CPU can do, against what a step's linears get: a large bf16 GEMM (the compute peak), a streamed read
(the memory rate), and the few-rows bf16 linear of the compiled steps on SmolLM2-135M's weight shapes for 1, 6 and
12 rows (the small matrices stay in cache between calls: compute-bound; the 49152 x 576 head streams from memory).
2 threads, 20-50 timed calls each after two warm-ups, mean kept.
Run: python kernel_peak.py > kernel_peak.txt"""
import time

import torch

from hf_treespec.cost.hardware import cpu_info
from hf_treespec.compiled.few_rows_linear import load_few_rows_linear

torch.set_num_threads(2)


def seconds(call, repeats: int = 20) -> float:
    call(), call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


name, flags = cpu_info()
print(f"{name} ({', '.join(flags)}), 2 threads, torch {torch.__version__}")
a, b = (torch.randn(2048, 2048, dtype=torch.bfloat16) for _ in range(2))
print(f"bf16 GEMM 2048^3: {2 * 2048 ** 3 / seconds(lambda: a @ b, 5) / 1e9:.0f} GFLOP/s")
big = torch.randn(32 * 1024 * 1024, dtype=torch.bfloat16)
print(f"streamed read (sum of 64 MiB): {big.numel() * 2 / seconds(big.sum, 10) / 1e9:.1f} GB/s")
op = load_few_rows_linear()
if op is None:
    raise SystemExit("the few-rows linear needs avx512_bf16 and a C++ compiler")
for n, k in [(576, 576), (1536, 576), (576, 1536), (49152, 576)]:
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    packed = torch.ops.hf_treespec.few_rows_pack(weight)
    for rows in (1, 6, 12):
        x = torch.randn(1, rows, k, dtype=torch.bfloat16)
        t = seconds(lambda: op(x, weight, packed, None), 50)
        print(f"few-rows linear {n}x{k}, {rows:2d} rows: {t * 1e6:6.0f} us, {n * k * 2 / t / 1e9:6.1f} GB/s of "
              f"weights, {2 * rows * n * k / t / 1e9:4.0f} GFLOP/s")
