"""Writes experiments/notebooks/tour.ipynb (the source of truth for the notebook's cells is this file).

    python experiments/notebooks/build_tour.py            # regenerate tour.ipynb (no outputs stored)

tests/experiments/test_notebook.py executes tour.ipynb top to bottom with nbclient and checks it matches this file.
"""

from __future__ import annotations

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "tour.ipynb")

CELLS = [
    ("md", """# dsv4 tour: model, caches, indexer picks, a layer swap, one cache ablation

1. load the model (the trained `v4_retrieval` checkpoint when it is shipped, else random `v4_tiny` weights);
2. run a prompt through `dsv4.model.forward_aux(..., collect_aux=True)` with a contiguous cache;
3. the cache pytree: array shapes per layer and cache group (`window_kv` etc. live in the paged *swa* group,
   compressed entries and indexer keys in the *full* group);
4. which compressed entries the Lightning indexer picked for a query (`topk_ids` of a CSA layer);
5. editing the model: the engine runs the Flax NNX modules, so replacing one layer's attention changes its output;
6. one ablation plot: SWA checkpoint retention interval vs tokens recomputed (`experiments/ablate_retention.py`)."""),
    ("code", """import os
import numpy as np
import jax, jax.numpy as jnp
import matplotlib
import matplotlib.pyplot as plt
from IPython.display import Image, display

from dsv4 import caches
from dsv4.model import forward_aux
from experiments.ablate_retention import load_model

config, params, source = load_model()
print("model:", source, "|", config.name, "| layers:", [p.kind for p in config.layer_plan()],
      "| window:", config.attention.window, "| vocab:", config.vocab_size)"""),
    ("md", "## Run a prompt with a contiguous cache (identity block tables, one sequence)"),
    ("code", """T = 96
rng = np.random.default_rng(0)
prompt = rng.integers(3, config.vocab_size, (1, T))
cache, swa_table, full_table = caches.init_contiguous(config, batch=1, max_len=128)
index = caches.BatchIndex(start_pos_B=jnp.array([0]), num_tokens_B=jnp.array([T]),
                          swa_table_BxS=jnp.asarray(swa_table), full_table_BxF=jnp.asarray(full_table))
cache, logits, aux = forward_aux(params, config, jnp.asarray(prompt), cache, index, collect_aux=True)
print("logits", logits.shape, "| swa table", swa_table.tolist(), "| full table", full_table.tolist())
print("greedy next tokens:", np.asarray(logits[0, -8:].argmax(-1)).tolist())"""),
    ("md", "## The cache pytree: one dict of paged arrays per layer, grouped by cache group"),
    ("code", """specs = {(s.layer, s.name): s for s in caches.cache_array_specs(config, caches.CacheLayout())}
for i, (plan, layer) in enumerate(zip(config.layer_plan(), cache.layers)):
  print(f"layer {i} ({plan.kind}, ratio {plan.ratio})")
  for name, arr in layer.items():
    s = specs.get((i, name))
    print(f"   {name:18s} {str(tuple(arr.shape)):16s} {str(arr.dtype):8s} group={s.group if s else '?'}")"""),
    ("md", """## Which compressed entries the indexer picked

`topk_ids[b, t, :]` lists the compressed entries (one per `ratio` tokens) query `t` reads besides its window;
-1 = unused slot (fewer visible entries than k). Heatmap: query positions x compressed entries, dark = picked."""),
    ("code", """csa = [i for i, a in enumerate(aux) if "topk_ids" in a]
print("layers with an indexer:", csa)
li = csa[0]
ids = np.asarray(aux[li]["topk_ids"][0])              # [T, k]
scores = np.asarray(aux[li]["index_scores"][0])       # [T, entries]
q = T - 1
print(f"layer {li}: topk_ids {ids.shape}; query {q} picked entries {sorted(int(x) for x in ids[q] if x >= 0)}")
top = np.argsort(-np.where(np.isfinite(scores[q]), scores[q], -np.inf))[:8]
print("  its 8 best index scores:", [(int(e), round(float(scores[q, e]), 3)) for e in top])
picked = np.zeros((T, scores.shape[1]))
for t in range(T):
  for e in ids[t]:
    if e >= 0:
      picked[t, e] = 1
fig, ax = plt.subplots(figsize=(6, 4))
ax.imshow(picked, aspect="auto", cmap="Greys", interpolation="nearest")
ax.set(xlabel="compressed entry id", ylabel="query position", title=f"layer {li}: indexer top-k picks")
import io
buf = io.BytesIO()          # experiments.plotting selects the Agg backend: render the figure as a PNG explicitly
fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
plt.close(fig)
display(Image(data=buf.getvalue()))"""),
    ("md", """## Edit the model: replace one layer's attention, the engine's output changes

`nnx_model.merge(config, params)` is the model as Flax NNX modules (`net.layers[i].attn`, `.ffn`, `.hc_attn`, ...).
Each block calls its own sub-modules, and the engine (`EngineConfig(model_api="nnx")`) runs the module it is given,
split into graph + state at every step. Here layer `k`'s attention is replaced by the same weights with a smaller
indexer top-k (8 -> 2): the next request's logits change; putting the original module back restores them."""),
    ("code", """import dataclasses
from dsv4 import nnx_model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

net = nnx_model.merge(config, params)
engine = Engine(net, config, EngineConfig(model_api="nnx", max_num_seqs=1, max_num_batched_tokens=32, chunk_size=32,
                                          max_model_len=128, num_full_blocks=8, num_swa_blocks=32,
                                          record_logits=True))
swap_prompt = prompt[0, :32].tolist()     # 32 tokens: 8 compressed entries at ratio 4, so top-k 2 drops some

def next_token():
  (out,) = generate(None, config, [swap_prompt], SamplingParams(max_tokens=1), engine=engine)
  return out.output[0], np.asarray(out.token_logits[0])

k = max(p.index for p in config.layer_plan() if p.has_index_query)       # the last CSA layer
tok_a, logits_a = next_token()
original = net.layers[k].attn
small = dataclasses.replace(config, indexer=dataclasses.replace(config.indexer, topk=2))
net.layers[k].attn = original.with_config(small)     # same weights; this layer alone selects 2 entries, not 8
tok_b, logits_b = next_token()
net.layers[k].attn = original
tok_c, logits_c = next_token()
print(f"layer {k} top-k {config.indexer.topk}: next token {tok_a}, top-5 {np.argsort(-logits_a)[:5].tolist()}")
print(f"layer {k} top-k 2:  next token {tok_b}, top-5 {np.argsort(-logits_b)[:5].tolist()}, "
      f"max |dlogit| {np.abs(logits_b - logits_a).max():.4f}")
print(f"original module back: next token {tok_c}, logits identical: {np.array_equal(logits_c, logits_a)}")
assert np.abs(logits_b - logits_a).max() > 0 and np.array_equal(logits_c, logits_a)"""),
    ("md", """## One ablation plot: retention interval

The full run's plot (`python -m experiments.ablate_retention`) if it is shipped; otherwise the `--small` sweep is run
inline (cache-only: it drives the KV cache manager, not the model)."""),
    ("code", """import tempfile
from experiments import ablate_retention
png = os.path.join(os.path.dirname(ablate_retention.__file__), "results", "retention.png")
if not os.path.exists(png):
  png = ablate_retention.run("v4_flash", [0, 128, 512], small=True, out_dir=tempfile.mkdtemp())["png"]
print(png)
display(Image(filename=png))"""),
]


def build() -> nbformat.NotebookNode:
  nb = new_notebook()
  nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in CELLS]
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  return nb


if __name__ == "__main__":
  nbformat.write(build(), PATH)
  print("wrote", PATH)
