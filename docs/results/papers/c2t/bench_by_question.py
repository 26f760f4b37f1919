"""`hf-treespec bench` one question at a time (question-major, each question's report in OUT/q<i>, finished ones skipped),
so a run cut short on a busy machine still leaves whole questions. Usage: OUT METHODS NUM_QUESTIONS MAX_NEW_TOKENS."""
import sys
from pathlib import Path

import torch

from hf_treespec.benchmark.loading import load_benchmark_questions, load_drafter, load_model
from hf_treespec.benchmark.report import write_report
from hf_treespec.benchmark.runner import BenchmarkConfig, run_benchmark

out, methods, num, new = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(1)
config = BenchmarkConfig(dtype="fp32", threads=1, dataset="mtbench", num_questions=num, max_new_tokens=new,
                         methods=methods, progress=False)
questions = load_benchmark_questions(config)
model, tok = load_model(config.model, config.resolved_dtype, config.resolved_device)
drafter = load_drafter(config.drafter, model, config.resolved_dtype, target_name=config.model)
for i, q in enumerate(questions):
    folder = Path(out) / f"q{i}"
    if (folder / "per_question.jsonl").is_file():
        continue
    result = run_benchmark(config, model=model, tokenizer=tok, drafter=drafter, questions=[q])
    write_report(result, folder)
    print("done", i, flush=True)
