"""What one sampled token costs to draw over SmolLM2's 49152-token vocabulary: torch.multinomial(probs, 1) against
hf_treespec.randomness.categorical_rows, 1 and 4 rows, fp32 probabilities, 2 threads, median of 5 x 200 calls.
Run: python draws.py > draws.txt"""
import statistics
import time

import torch

from hf_treespec.cost.hardware import cpu_info
from hf_treespec.randomness import categorical_rows

torch.set_num_threads(2)
name, flags = cpu_info()
print(f"# {name}; {' '.join(f for f in flags if f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_bf16'))}; "
      f"torch {torch.__version__}, 2 threads")
draws = {"torch.multinomial(probs, 1)": lambda probs: torch.multinomial(probs, 1),
         "categorical_rows(probs)": categorical_rows}
for rows in (1, 4):
    probs = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)).mul(3).softmax(-1)
    for label, draw in draws.items():
        for _ in range(20):
            draw(probs)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                draw(probs)
            times.append((time.perf_counter() - start) / 200)
        print(f"{rows} row(s)  {label:28s} {statistics.median(times) * 1e3:.3f} ms")
