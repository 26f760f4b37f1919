"""Compile-once experiment (issue 49): the target's multi-row step, exported with torch.export (rows, context and
buffer capacity dynamic; KV buffers written in place at the step's slots, lean attention) and compiled ahead of time
by AOTInductor into a package on disk (freezing on, no autotuning); a second process only loads the package.
Prints export / compile / load seconds, the step's median ms, and its logits against the eager step in the same
dtype and in fp32 (random tokens over a zero KV context: an input bf16 rounds badly, which the fp32 column shows for
eager bf16 too). Usage: DTYPE=bfloat16|float32 python aoti_step.py build|load [tiny]"""
import os, sys, time, statistics, torch
from transformers import DynamicCache
from hf_treespec.compiled.preallocated import PreallocatedLayer, WriteSlots
from hf_treespec.compiled.attention import use_lean_attention
from hf_treespec.attention import causal_row_mask
from hf_treespec.compat import CACHE_KWARG
torch.set_num_threads(2)
torch.manual_seed(0)
DT = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
mode = sys.argv[1]
tiny = "tiny" in sys.argv[2:]
PKG = os.environ.get("PACKAGE_DIR", "/tmp") + "/aoti_step_%s_%s_%s.pt2" % ('tiny' if tiny else 'smol', os.environ.get('DTYPE', 'bfloat16'), os.environ.get('FREEZE', '1'))
if tiny:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, rope_theta=100000.0)).to(DT).eval()
else:
    from hf_treespec.assets import load_target
    model, _ = load_target("smollm2-135m-instruct", dtype=DT)
model.config.use_cache = True
lean = use_lean_attention(model)
L = model.config.num_hidden_layers


class Step(torch.nn.Module):
    """A step over KV buffers given as inputs (written in place at `slots`); returns logits."""
    def __init__(self, model):
        super().__init__(); self.model = model
    def forward(self, input_ids, position_ids, mask, slots, keys, values):
        torch._check(mask.shape[-1] < keys[0].shape[2])  # lean attention: the mask covers fewer rows than the buffer
        cache = DynamicCache(config=self.model.config)
        ws = WriteSlots(); ws.index = slots
        for i in range(L):
            layer = PreallocatedLayer(keys[i].shape[2], ws)
            layer.key_buffer, layer.value_buffer = keys[i], values[i]
            layer.keys, layer.values = keys[i][..., :0, :], values[i][..., :0, :]
            layer.is_initialized = True
            cache.layers[i] = layer
        return self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                          **{CACHE_KWARG: cache}).logits

kvh = model.config.num_key_value_heads; hd = model.config.hidden_size // model.config.num_attention_heads
def buffers(cap):
    return ([torch.zeros(1, kvh, cap, hd, dtype=DT) for _ in range(L)],
            [torch.zeros(1, kvh, cap, hd, dtype=DT) for _ in range(L)])
def inputs(ctx, rows, cap):
    ids = torch.randint(0, model.config.vocab_size, (1, rows))
    pos = torch.arange(ctx, ctx + rows)[None]
    mask = causal_row_mask(rows, ctx + rows, DT, "cpu")
    slots = torch.arange(ctx, ctx + rows)
    return ids, pos, mask, slots

if mode == "build":
    from torch.export import Dim, export
    rows = used = cap = Dim.AUTO
    ks, vs = buffers(64)
    args = (*inputs(8, 8, 64), ks, vs)
    kv = [{2: cap}] * L
    shapes = ({1: rows}, {1: rows}, {2: rows, 3: used}, {0: rows}, kv, kv)
    t = time.perf_counter()
    with torch.no_grad():
        ep = export(Step(model), args, dynamic_shapes=shapes, strict=False)
    print("export", round(time.perf_counter() - t, 1), "s", flush=True)
    t = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(ep, package_path=PKG, inductor_configs={"freezing": os.environ.get("FREEZE", "1") == "1", "max_autotune": False})
    print("aoti compile", round(time.perf_counter() - t, 1), "s ->", path, flush=True)
t = time.perf_counter()
runner = torch._inductor.aoti_load_package(PKG)
print("load", round(time.perf_counter() - t, 2), "s", flush=True)
step = Step(model)
import copy
m32 = copy.deepcopy(model).float(); step32 = Step(m32)
with torch.inference_mode():
    for ctx in (128, 512):
        for rows in (2, 8, 16):
            ks, vs = buffers(ctx + 64)
            ks2 = [k.clone() for k in ks]; vs2 = [v.clone() for v in vs]
            ts = []
            for rep in range(6):
                a = inputs(ctx, rows, ctx + 64)
                s = time.perf_counter(); out = runner(*a, ks, vs); ts.append(time.perf_counter() - s)
            ref = step(*a, ks2, vs2)
            ref32 = step32(*a[:2], a[2].float(), a[3], [k.float() * 0 for k in ks2], [v.float() * 0 for v in vs2])
            print("   vs fp32 eager: aoti %.3g, eager bf16 %.3g" % (float((out.float() - ref32).abs().max()), float((ref.float() - ref32).abs().max())))
            # the buffers the AOTI step wrote must equal what the eager step writes
            wrote = max(float((k[..., ctx:ctx + rows, :].float() - k2[..., ctx:ctx + rows, :].float()).abs().max()) for k, k2 in zip(ks, ks2))
            print(f"ctx {ctx} rows {rows}: {1e3 * statistics.median(ts[1:]):.1f} ms  max|logit diff| {float((out.float() - ref.float()).abs().max()):.3g}  kv write diff {wrote:.3g}", flush=True)
