"""Held-out offline check (the analogue of the paper's Tables 4-5 on Eq. 3 / Eq. 11 estimates): per verifier and
feature set, a selector trained on the roots of the first prompts of each temperature folder, scored on the roots
of the later prompts. Reports mean estimated tau and the Eq. 4 throughput ratio of the selector's argmax action to
the best static action of the training roots (the paper's baseline), and the per-root oracle's."""
import json, sys, collections
import torch
from hf_treespec.trainers import NDEConfig, NDETrainer
from hf_treespec.trainers.nde import build_selector, setting_key
from hf_treespec.trainers.nde_data import NDEData, load_nde_data

torch.set_num_threads(1)
split = int(sys.argv[1]) if len(sys.argv) > 1 else 9
folders = ["runs/nde/data-T1.0", "runs/nde/data-T0.6"]
out = {}
for v in ("specinfer", "spectr", "khisti"):
    data = load_nde_data(folders, v)
    train = NDEData(data.dataset.filter(lambda r: r["prompt"] < split), data.meta)
    test = data.dataset.filter(lambda r: r["prompt"] >= split).with_format("torch")[:]
    tau, sec = test["block_efficiency"].double(), test["seconds"].double()
    names = data.meta["scalar_features"]
    for fs in ("paper", "root"):
        torch.manual_seed(0)
        selector = build_selector(train, feature_set=fs)
        args = NDEConfig(output_dir=f"/tmp/nde-heldout-{v}-{fs}", save_strategy="no", use_cpu=True, disable_tqdm=True,
                         logging_steps=1000)
        NDETrainer(selector, args, train_dataset=train).train()
        selector.eval()
        idx = [names.index(n) for n in selector.config.scalar_features]
        with torch.no_grad():
            pick = selector(test["scalars"].float()[:, idx],
                            **{n: test[n].float() for n in selector.config.hidden_inputs}).argmax(-1)
        rows = {}
        for T in sorted(set(test["temperature"].tolist())):
            m = test["temperature"] == T
            base = selector.config.actions.index(selector.config.baseline_actions[setting_key(T, 1.0)])
            static = tau[m, base].sum() / sec[m, base].sum()
            chosen = pick[m, None]
            orc = (tau[m] / sec[m]).argmax(1, keepdim=True)
            rows[f"T={T:g}"] = {
                "heldout_roots": int(m.sum()), "train_roots": len(train), "baseline_action": selector.config.actions[base],
                "baseline_tau": round(float(tau[m, base].mean()), 3),
                "nde_tau": round(float(tau[m].gather(1, chosen).mean()), 3),
                "nde_vs_baseline_tau": round(float(tau[m].gather(1, chosen).mean() / tau[m, base].mean()), 3),
                "nde_vs_baseline_tps": round(float(tau[m].gather(1, chosen).sum() / sec[m].gather(1, chosen).sum() / static), 3),
                "oracle_vs_baseline_tps": round(float(tau[m].gather(1, orc).sum() / sec[m].gather(1, orc).sum() / static), 3),
                "distinct_actions": len(set(pick[m].tolist())),
            }
        out[f"{v}/{fs}"] = rows
        print(v, fs, json.dumps(rows), flush=True)
json.dump(out, open("runs/nde/heldout.json", "w"), indent=1)
