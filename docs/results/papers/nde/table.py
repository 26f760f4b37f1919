"""Tau table from the two bench runs: per verifier NDE (paper / root features) vs the fixed delayed shapes, plus
Traversal; tau pooled over questions (new tokens / target forwards), +- the standard error over questions."""
import json, math, sys, collections
rows = collections.OrderedDict()
out = {}
for T in ("0.6", "1.0"):
    recs = collections.defaultdict(list)
    for line in open(f"runs/nde/bench-T{T}/per_question.jsonl"):
        r = json.loads(line)
        recs[r["method"]].append(r)
    summ = {m["method"]: m for m in json.load(open(f"runs/nde/bench-T{T}/summary.json"))["methods"]}
    for method, rs in recs.items():
        if method == "plain":
            continue
        taus = [r["tau"] for r in rs]
        mean = sum(taus) / len(taus)
        se = math.sqrt(sum((t - mean) ** 2 for t in taus) / (len(taus) - 1) / len(taus)) if len(taus) > 1 else float("nan")
        out.setdefault(method, {})[T] = {"tau": round(summ[method]["tau"], 3), "tau_question_mean": round(mean, 3),
                                         "se": round(se, 3), "tree_size": round(summ[method]["mean_tree_size"] or 0, 2),
                                         "questions": len(taus)}
json.dump(out, open("runs/nde/tau_table.json", "w"), indent=1)
def label(m):
    parts = dict(p.split("=") for p in m.split("@")[1:])
    v = parts["verifier"]
    if m.startswith("tree:nde"):
        return v, f"NDE ({parts['tree_selector'].rsplit('-', 1)[1]} features)"
    return v, f"delayed k={parts['tree_paths']}, l1={parts['delay_trunk']}, l2={parts['delay_branch']}"
print("| verifier | tree | tau T=0.6 | tau T=1 | nodes/step T=0.6 | nodes/step T=1 |")
print("|---|---|---:|---:|---:|---:|")
for m, by in out.items():
    v, name = label(m)
    cells = [f"{by[T]['tau']:.2f} ± {by[T]['se']:.2f}" if T in by else "-" for T in ("0.6", "1.0")]
    sizes = [f"{by[T]['tree_size']:.1f}" if T in by else "-" for T in ("0.6", "1.0")]
    print(f"| {v} | {name} | {cells[0]} | {cells[1]} | {sizes[0]} | {sizes[1]} |")
