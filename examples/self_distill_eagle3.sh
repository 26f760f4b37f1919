#!/usr/bin/env bash
# A self-distilled EAGLE-3 drafter for SmolLM2-135M-Instruct, end to end:
#   regenerate (the target answers ShareGPT train prompts) -> prepare (EAGLE-3 low/mid/high layers + TALF trees, for
#   the target's answers and ShareGPT's)
#   -> train ttt (EAGLE-3 training-time test, 7 steps, + TALF tree loss) -> evaluate (ShareGPT dev, MT-bench)
#   -> ship (Hub layout + model card, keeping the delay selector and the C2T classifier).
# Every step resumes: rerun the script after any interruption (finished regenerate / prepare chunks are skipped,
# training continues from its last checkpoint). On a GPU machine every step runs there; bring back only $RUNS/ship.
#
#   GPU:  RUNS=runs PROMPTS=16000 bash examples/self_distill_eagle3.sh
#         (measured in part on one H100, docs/history.md 2026-11-26: `prepare` without trees ~24k tokens/s per process;
#         TTT ~5.7k tokens/s at batch 16. Regenerate in ONE process: several processes on one GPU take turns.
#         On a rented GPU, TRAIN_SECONDS=3600 ends training annealed after an hour, whatever the step time.)
#   CPU:  RUNS=runs PROMPTS=1000 THREADS=2 bash examples/self_distill_eagle3.sh (~3 h of regenerate + prepare per million tokens on 2 avx512_bf16 cores, docs/history.md)
#   STEPS="regenerate prepare" bash examples/self_distill_eagle3.sh             (run only some steps)
#   TINY=1 RUNS=/tmp/tiny bash examples/self_distill_eagle3.sh   (every step on a handful of tokens: what the tests run)
set -euo pipefail
RUNS=${RUNS:-runs}
PYTHON=${PYTHON:-python3}
if [[ "${TINY:-0}" == "1" ]]; then      # the same commands on two prompts and a few tokens: checks the recipe runs
    PROMPTS=2; TEMPERATURES=0; MAX_NEW=8; MAX_LENGTH=128; DEV_CONVERSATIONS=1; EPOCHS=1; QUESTIONS=1
    BENCH_TOKENS=8; IDENTITY_QUESTIONS=1; REPEATS=1; THREADS=${THREADS:-1}
fi
MAX_LENGTH=${MAX_LENGTH:-1536}; DEV_CONVERSATIONS=${DEV_CONVERSATIONS:-200}; EPOCHS=${EPOCHS:-10}
QUESTIONS=${QUESTIONS:-40}; BENCH_TOKENS=${BENCH_TOKENS:-128}; IDENTITY_QUESTIONS=${IDENTITY_QUESTIONS:-20}
REPEATS=${REPEATS:-3}
PROMPTS=${PROMPTS:-16000}          # ShareGPT train prompts (16,000 = the whole train split; dev/reserved never read)
TEMPERATURES=${TEMPERATURES:-0,0.8} # one answer per prompt and temperature: greedy + a sampled variant
MAX_NEW=${MAX_NEW:-512}
STEPS=${STEPS:-"regenerate prepare train evaluate ship"}
HF=${HF:-"$PYTHON -m hf_treespec.cli"}   # or `hf-treespec` when installed
if $PYTHON -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    # one generate call of 768 sequences: a 135M target leaves an H100 idle at small batches (4 processes x 128 ran
    # ~105 ms a step each, taking turns); the KV cache of 768 x 1.5k tokens is ~26 GB
    DTYPE=bf16; BATCH=${BATCH:-768}; BATCH_TOKENS=65536; CHUNK=768; TRAIN_BATCH=16; THREADS_OPT=""
    PRECISION=bf16
else
    # CPUs without avx512_bf16 run bf16 matmuls slowly: fp32 is the fast dtype there
    if grep -q avx512_bf16 /proc/cpuinfo; then DTYPE=bf16; else DTYPE=fp32; fi
    BATCH=${BATCH:-8}; BATCH_TOKENS=4096; CHUNK=64; TRAIN_BATCH=4; THREADS_OPT="--threads ${THREADS:-2}"
    PRECISION=auto
fi
run() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# 1. self-distilled data: JSONL chunks of token ids (prompt + the target's answer), tokens/s on the progress bar
if run regenerate; then
    $HF train regenerate --num-prompts "$PROMPTS" --temperature "$TEMPERATURES" --max-new-tokens "$MAX_NEW" \
        --max-prompt-tokens 1024 --dtype "$DTYPE" --batch-size "$BATCH" --chunk-size "$CHUNK" $THREADS_OPT \
        --output "$RUNS/regen/train"
fi

# 2. features: EAGLE-3's low / mid / high target layers (SmolLM2-135M: layers 1, 14, 26) + the pre-norm last state
#    for the soft labels, bf16 on disk, and EAGLE-2 target trees (k 4, depth 3) at 32 positions per answer (TALF).
#    Held-out data: the target's greedy chain (depth 7) at every assistant position of ShareGPT dev.
if run prepare; then
    $HF train prepare --data-file "$RUNS/regen/train" --num-conversations 0 --input-mode eagle3 \
        --max-length "$MAX_LENGTH" --dtype "$DTYPE" --storage-dtype bfloat16 --chunk-size "$CHUNK" \
        --batch-tokens "$BATCH_TOKENS" --tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 32 \
        $THREADS_OPT --output "$RUNS/data/regen-e3"
    # ShareGPT's own answers beside the target's: the mix beat ShareGPT's answers alone on both held-out sets
    # (docs/history.md, 2026-11-25, fifth learning-curve run: +0.17 dev chain tau, +0.21 MT-bench SALF tau at 1.6x
    # the tokens)
    $HF train prepare --split train --num-conversations "$PROMPTS" --input-mode eagle3 \
        --max-length "$MAX_LENGTH" --dtype "$DTYPE" --storage-dtype bfloat16 --chunk-size "$CHUNK" \
        --batch-tokens "$BATCH_TOKENS" --tree-policy eagle2 --tree-topk 4 --tree-depth 3 --tree-positions 32 \
        $THREADS_OPT --output "$RUNS/data/sharegpt-e3"
    $HF train prepare --split dev --num-conversations "$DEV_CONVERSATIONS" --input-mode eagle3 \
        --max-length "$MAX_LENGTH" --dtype "$DTYPE" --tree-policy chain --tree-depth 7 --tree-positions all $THREADS_OPT --output "$RUNS/data/dev-e3"
fi

# 3. EAGLE-3 layout + training-time test (7 drafter passes on its own features) + TALF's tree nodes, one unroll;
#    checkpoints every 500 steps, --resume continues from the last one.
if run train; then
    $HF train ttt --data "$RUNS/data/regen-e3" "$RUNS/data/sharegpt-e3" --eval-data "$RUNS/data/dev-e3" \
        --input-mode eagle3 --ttt-steps 7 --epochs "$EPOCHS" --batch-size "$TRAIN_BATCH" --draft-vocab-size 8192 \
        --precision "$PRECISION" --save-strategy steps --save-steps 500 --resume $THREADS_OPT \
        ${TRAIN_SECONDS:+--max-train-seconds "$TRAIN_SECONDS"} --output-dir "$RUNS/ttt-e3"
fi

# 4. held-out acceptance per depth (chain tau) and SALF on MT-bench first turns (40 questions, 128 tokens),
#    greedy and at temperature 1, against plain generate and transformers' assisted generation in the same run
#    (assisted_lookup: transformers' assisted_drafter needs a causal-LM drafter, not a feature drafter).
if run evaluate; then
    $HF train evaluate --data "$RUNS/data/dev-e3" --drafter "$RUNS/ttt-e3" $THREADS_OPT \
        --output "$RUNS/ttt-e3/acceptance.json"
    for T in 0 1; do
        $HF bench --drafter "$RUNS/ttt-e3" --methods plain,assisted_lookup,tree:salf --num-questions "$QUESTIONS" \
            --max-new-tokens "$BENCH_TOKENS" --temperature "$T" --dtype "$DTYPE" --repeats "$REPEATS" $THREADS_OPT \
            --out "$RUNS/bench-e3-T$T"
        # the same trees drafted by the target itself: the tau ceiling this drafter is measured against
        $HF bench --drafter oracle --methods tree:salf --num-questions "$QUESTIONS" \
            --max-new-tokens "$BENCH_TOKENS" --temperature "$T" --dtype "$DTYPE" $THREADS_OPT \
            --out "$RUNS/bench-oracle-T$T"
    done
    # fp32 greedy identity with plain generate (20/20 expected)
    $HF bench --drafter "$RUNS/ttt-e3" --methods plain,tree:salf --num-questions "$IDENTITY_QUESTIONS" \
        --max-new-tokens "$BENCH_TOKENS" --dtype fp32 --repeats 1 $THREADS_OPT --out "$RUNS/bench-e3-identity"
fi

# 5. ship: weights + config in the Hub layout, the shipped NDE delay selector and C2T classifier carried over
#    (re-check them, or retrain with `hf-treespec train nde-data/nde` and `c2t-data/c2t`, before a release),
#    model card regenerated with the measured numbers (edit RESULTS below from $RUNS/bench-e3-T*/table.md).
if run ship; then
    RUNS="$RUNS" $PYTHON - <<'EOF'
import json, os, shutil
from pathlib import Path

from hf_treespec.assets import shipped_drafter_path
from hf_treespec.drafters import TreeSpecDrafterModel
from hf_treespec.model_card import make_card

runs = Path(os.environ["RUNS"])
out = runs / "ship"
drafter = TreeSpecDrafterModel.from_pretrained(runs / "ttt-e3")
drafter.save_pretrained(out)
for helper in ("delay_selector", "c2t"):  # trained with an earlier drafter: re-check them (BENCHMARKS.md)
    shutil.copytree(shipped_drafter_path() / helper, out / helper, dirs_exist_ok=True)
acceptance = json.loads((runs / "ttt-e3" / "acceptance.json").read_text())
results = {"ShareGPT dev (chain tau)": next(iter(acceptance.values()))}
card = make_card(drafter.config, base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                 data="anon8231489123/ShareGPT_Vicuna_unfiltered",
                 objective=("EAGLE-3 training-time test (7 steps) + TALF tree loss (EAGLE-2 trees, k 4, depth 3) on "
                            "ShareGPT train conversations and the target's own answers to their prompts"),
                 draft_vocab_size=drafter.config.draft_vocab_size, results=results,
                 command="bash examples/self_distill_eagle3.sh", target_asset="smollm2-135m-instruct")
card.save(out / "README.md")
size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 2**20
print(f"{out}: {size:.1f} MiB (ship if <= 20 MiB: copy into hf_treespec/assets_data/drafters/smollm2-135m-instruct/)")
EOF
fi
