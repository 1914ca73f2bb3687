"""Training / evaluation helpers for the long-range retrieval experiments (see TRAIN_NOTES.md).

    config, params = load_trained("v4_retrieval")      # the shipped checkpoint
    acc = evaluate(params, config, spec, ...)          # task accuracy (dataclasses.replace config to vary top-k)

Loss = cross-entropy on the answer tokens + `kl_weight` * KL(stop_grad(comp_attn_target) || softmax(index_scores))
on every V4 CSA layer (the indexer learns to rank compressed entries like the main attention does when it reads
them all, as DeepSeek warm up their Lightning indexer).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv4 import caches
from dsv4.config import AttentionConfig, IndexerConfig, ModelConfig, v41_tiny, v4_tiny
from dsv4.loading.orbax_io import restore_params, save_params
from dsv4.model import count_params, forward_aux, init_params
from experiments import tasks

CHECKPOINT_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


# ----------------------------------------------------------------------------------------------------------
# Configs

def retrieval_config(variant: str = "v4", *, num_layers: int = 2, window: int = 16, vocab_size: int = 64,
                     index_topk: int = 8, hidden_size: int = 64) -> ModelConfig:
  """The small model trained here. V4: layer 0 = sliding window only, layer 1 = CSA (ratio 4 + indexer).

  Deliberately no HCA layer: HCA reads *all* compressed entries densely, so with one the model could answer
  without the top-k and a top-k ablation would measure nothing."""
  if variant == "v4":
    cfg = v4_tiny(num_layers=num_layers, window=window, vocab_size=vocab_size, index_topk=index_topk)
    if hidden_size != cfg.hidden_size:
      cfg = dataclasses.replace(cfg, hidden_size=hidden_size)
    return dataclasses.replace(cfg, name=f"v4_retrieval_L{num_layers}_W{window}")
  if variant == "v41":
    # Small V4.1 mirroring the V4 one (dims of dsv4.config.v41_tiny): layer 0 window-only, layer 1 a ratio-2
    # KV-source ("full") layer with its own indexer, layers 2.. ratio-2 "reuse" layers (they read layer 1's
    # compressed KV with layer 1's top-k). No Engram, no candidate source, no ratio-1 layers: like the V4 model's
    # missing HCA, anything that reads the compressed entries without the top-k would make a top-k ablation moot.
    base = v41_tiny(engram=False, vocab_size=vocab_size)
    ratios = (0,) + (2,) * (num_layers - 1)
    return dataclasses.replace(
        base, name=f"v41_retrieval_L{num_layers}_W{window}", hidden_size=hidden_size, num_layers=num_layers,
        compress_ratios=ratios, attention=dataclasses.replace(base.attention, window=window),
        indexer=dataclasses.replace(base.indexer, topk=index_topk), kv_source_layer_ids=(1,),
        index_source_layer_ids=(1,), candidate_source_layer_id=-1)
  raise ValueError(f"unknown variant {variant!r}")


def dense_topk(config: ModelConfig, seq_len: int) -> int:
  """Top-k that reads every visible compressed entry at seq_len (seq_len // smallest index-layer ratio)."""
  ratios = [p.ratio for p in config.layer_plan() if p.has_index_query] or [4]
  return max(seq_len // min(ratios), config.indexer.topk)


def with_topk(config: ModelConfig, k: int) -> ModelConfig:
  return dataclasses.replace(config, indexer=dataclasses.replace(config.indexer, topk=int(k)))


def with_window(config: ModelConfig, w: int) -> ModelConfig:
  return dataclasses.replace(config, attention=dataclasses.replace(config.attention, window=int(w)))


def config_to_dict(config: ModelConfig) -> dict:
  return dataclasses.asdict(config)


def _from_dict(cls, d: dict):
  """Rebuild a (nested, frozen) config dataclass from `dataclasses.asdict` output; lists become tuples."""
  hints = typing.get_type_hints(cls)
  kw = {}
  names = {f.name for f in dataclasses.fields(cls)}
  for k, v in d.items():
    if k not in names:
      raise ValueError(f"{cls.__name__}: unknown field {k!r} in the saved config (model config changed?)")
    t = hints.get(k)
    if dataclasses.is_dataclass(t) and isinstance(v, dict):
      kw[k] = _from_dict(t, v)
    elif isinstance(v, list):
      kw[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v)
    else:
      kw[k] = v
  return cls(**kw)


def config_from_dict(d: dict) -> ModelConfig:
  """Inverse of `config_to_dict`; fields added to ModelConfig since the save keep their defaults."""
  return _from_dict(ModelConfig, d)


# ----------------------------------------------------------------------------------------------------------
# Params: integer leaves (hash-MoE tid2eid) are fixed, float leaves are trained.

def split_params(params):
  is_float = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
  floats = jax.tree_util.tree_map(lambda x: x if is_float(x) else None, params)
  ints = jax.tree_util.tree_map(lambda x: None if is_float(x) else x, params)
  return floats, ints


def merge_params(floats, ints):
  return jax.tree_util.tree_map(lambda f, i: i if f is None else f, floats, ints, is_leaf=lambda x: x is None)


# ----------------------------------------------------------------------------------------------------------
# Forward / loss

def _full_index(config: ModelConfig, B: int, T: int):
  cache, swa, full = caches.init_contiguous(config, B, T)
  index = caches.BatchIndex(jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))
  return cache, index


def run_model(params, config: ModelConfig, tokens, collect_aux: bool = True):
  B, T = tokens.shape
  cache, index = _full_index(config, B, T)
  _, logits, auxes = forward_aux(params, config, tokens, cache, index, collect_aux=collect_aux)
  return logits, auxes


def indexer_kl(aux: dict, weight_BxT):
  """KL(stop_grad(target) || softmax(index_scores)) over visible entries, weighted mean over positions."""
  s = aux["index_scores"]
  p = jax.lax.stop_gradient(aux["comp_attn_target"])
  vis = jnp.isfinite(s)
  any_vis = jnp.any(vis, axis=-1)
  logq = jax.nn.log_softmax(jnp.where(vis, s, -1e30), axis=-1)
  pos = vis & (p > 0)
  kl = jnp.sum(jnp.where(pos, p * (jnp.log(jnp.where(pos, p, 1.0)) - logq), 0.0), axis=-1)
  w = weight_BxT * any_vis
  return jnp.sum(kl * w) / jnp.maximum(jnp.sum(w), 1.0)


def _entry_covers(n, s, ratio: int, overlap: bool):
  """Whether compressed entry n holds token s. V4 CSA (overlapping, width 2m stride m): tokens [m(n-1), m(n+1));
  V4.1 / non-overlapping (ratio m): tokens [m n, m(n+1)) (ratio 2: entry n = tokens 2n, 2n+1)."""
  lo = ratio * (n - 1) if overlap else ratio * n
  return (lo <= s) & (s < ratio * (n + 1))


def index_layer_plans(config: ModelConfig):
  """Plans of the layers whose aux carries index_scores / comp_attn_target (V4 CSA; V4.1 full / reindex)."""
  return [p for p in config.layer_plan() if p.has_index_query]


def _src3(src_pos):
  """[B,T] (one source token per answer) or [B,T,S] (several, -1 padded) -> [B,T,S]."""
  return src_pos[..., None] if src_pos.ndim == 2 else src_pos


def attention_supervision(aux: dict, src_pos, mask_BxT, ratio: int = 4, overlap: bool = True):
  """-log of the (dense, head-averaged) main-attention mass on the compressed entries that hold any of the answer's
  source tokens (entries s//ratio and s//ratio + 1 of an overlapping CSA compressor, entry s//ratio of a
  non-overlapping V4.1 one, for every source s), at the answer positions. `src_pos` is [B,T] (kv recall: the value token) or [B,T,S] (counting: all occurrences)."""
  p = aux["comp_attn_target"]
  M = p.shape[-1]
  n = jnp.arange(M)[None, None, None, :]
  s = _src3(src_pos)[..., None]
  hold = jnp.any(_entry_covers(n, s, ratio, overlap) & (s >= 0), axis=2)
  mass = jnp.sum(jnp.where(hold, p, 0.0), axis=-1)
  nll = -jnp.log(jnp.maximum(mass, 1e-9))
  return jnp.sum(nll * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1.0)


def loss_fn(fparams, iparams, config: ModelConfig, batch: dict, kl_weight: float, kl_on_all: bool,
            attn_sup_weight: float = 0.0):
  params = merge_params(fparams, iparams)
  logits, auxes = run_model(params, config, batch["tokens"], collect_aux=True)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  mask = batch["mask"]
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
  ce = jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  acc = jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  kls = [indexer_kl(a, jnp.ones_like(mask) if kl_on_all else mask) for a in auxes if "index_scores" in a]
  kl = sum(kls) / max(len(kls), 1) if kls else jnp.float32(0.0)
  loss = ce + kl_weight * kl
  sup = jnp.float32(0.0)
  if attn_sup_weight:
    sups = [attention_supervision(a, batch["src_pos"], mask, plan.ratio, plan.overlap)
            for plan, a in zip(config.layer_plan(), auxes) if "comp_attn_target" in a]
    sup = sum(sups) / len(sups)
    loss = loss + attn_sup_weight * sup
  return loss, dict(ce=ce, kl=kl, acc=acc, attn_sup=sup)


def make_optimizer(lr: float, warmup: int, total: int, weight_decay: float = 0.01, clip: float = 1.0):
  sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(total, warmup + 1), lr * 0.05)
  return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(sched, weight_decay=weight_decay)), sched


def make_draft_train_step(loss_fn, opt):
  """A jitted optimizer step for a drafter on a frozen backbone (experiments/mtp_lib.py, dspark_lib.py):
  loss_fn(draft_params, params, *batch) -> (loss, aux) is differentiated in draft_params only. Returns
  step(draft_params, params, opt_state, *batch) -> (draft_params, opt_state, loss, aux)."""
  @jax.jit
  def step(draft_params, params, opt_state, *batch):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(draft_params, params, *batch)
    updates, opt_state = opt.update(grads, opt_state, draft_params)
    return optax.apply_updates(draft_params, updates), opt_state, loss, aux
  return step


def make_train_step(config: ModelConfig, opt, kl_weight: float, kl_on_all: bool, attn_sup_weight: float = 0.0):
  @jax.jit
  def step(fparams, iparams, opt_state, batch):
    (loss, m), g = jax.value_and_grad(loss_fn, has_aux=True)(fparams, iparams, config, batch, kl_weight,
                                                             kl_on_all, attn_sup_weight)
    updates, opt_state = opt.update(g, opt_state, fparams)
    fparams = optax.apply_updates(fparams, updates)
    m = dict(m, loss=loss, gnorm=optax.global_norm(g))
    return fparams, opt_state, m
  return step


# ----------------------------------------------------------------------------------------------------------
# Evaluation

def value_entry_hit(topk_ids_BxTxK, src_pos, ratio: int = 4, overlap: bool = True):
  """Fraction of the answer's source tokens (src_pos [B,T] or [B,T,S], -1 padded) that lie in a picked entry,
  per position [B,T] (kv recall: 0/1, whether the asked value token is covered).

  V4 CSA entry n pools tokens [ratio*(n-1), ratio*(n+1)); a V4.1 entry tokens [ratio*n, ratio*(n+1))."""
  ids = topk_ids_BxTxK[:, :, None, :]
  s3 = _src3(src_pos)
  s = s3[..., None]
  cov = jnp.any((ids >= 0) & _entry_covers(ids, s, ratio, overlap), axis=-1)
  valid = s3 >= 0
  return jnp.sum(cov & valid, axis=-1) / jnp.maximum(jnp.sum(valid, axis=-1), 1)


@functools.partial(jax.jit, static_argnames=("config", "ablate"))
def _eval_step(params, config: ModelConfig, tokens, targets, mask, src_pos, ablate: str = "none"):
  if ablate == "no_compressed":
    # Compressed KV of every compressor set to zero vectors: the compressed path carries no information.
    params = jax.tree_util.tree_map(lambda x: x, params)
    for l, plan in enumerate(config.layer_plan()):
      if plan.has_compressor:
        c = dict(params["layers"][l]["attn"]["compressor"])
        c["wkv"] = jnp.zeros_like(c["wkv"])
        params["layers"][l]["attn"]["compressor"] = c
  logits, auxes = run_model(params, config, tokens, collect_aux=True)
  correct = (jnp.argmax(logits, -1) == targets) * mask
  hits = [value_entry_hit(a["topk_ids"], src_pos, plan.ratio, plan.overlap) * mask
          for plan, a in zip(config.layer_plan(), auxes) if "topk_ids" in a]
  hit = sum(jnp.sum(h) for h in hits) / max(len(hits), 1) if hits else jnp.float32(0.0)
  return jnp.sum(correct, axis=-1), jnp.sum(mask), hit


def _copy_tree(params):
  # nested dict/list copy so _eval_step's in-place dict edits never touch the caller's tree
  if isinstance(params, dict):
    return {k: _copy_tree(v) for k, v in params.items()}
  if isinstance(params, (list, tuple)):
    return type(params)(_copy_tree(v) for v in params)
  return params


def evaluate(params, config: ModelConfig, spec, num_batches: int = 8, batch: int = 16,
             ablate: str = "none", seed_offset: int = 0) -> dict:
  """Accuracy of the answers on held-out seeds, plus the indexer hit rate: mean over answers of the fraction of
  the answer's source tokens (kv recall: the asked value; counting: every occurrence of the key) that lie in a
  top-k entry. Counting also reports `acc_by_count` {c: accuracy on the answers with true count c}."""
  c = n = h = 0.0
  pc = pn = 0.0
  by_c: dict[int, list[float]] = {}
  for b in tasks.eval_batches(spec, num_batches, batch, seed_offset):
    cc, nn, hh = _eval_step(_copy_tree(params), config, jnp.asarray(b["tokens"]), jnp.asarray(b["targets"]),
                            jnp.asarray(b["mask"]), jnp.asarray(b["src_pos"]), ablate)
    cc = np.asarray(cc)
    c, n, h = c + float(cc.sum()), n + float(nn), h + float(hh)
    if "pred_mask" in b:   # motif: accuracy on the predictable targets only (repeats, no substitution)
      pcc, pnn, _ = _eval_step(_copy_tree(params), config, jnp.asarray(b["tokens"]), jnp.asarray(b["targets"]),
                               jnp.asarray(b["pred_mask"]), jnp.asarray(b["src_pos"]), ablate)
      pc, pn = pc + float(np.asarray(pcc).sum()), pn + float(pnn)
    if "count" in b:
      for cnt, ok in zip(b["count"], cc):
        by_c.setdefault(int(cnt), []).append(float(ok))
  out = dict(accuracy=c / max(n, 1), index_hit=h / max(n, 1), n=int(n), chance=1.0 / spec.num_values)
  if pn:
    out.update(accuracy_predictable=pc / pn, predictable_share=pn / max(n, 1))
  if by_c:
    out["acc_by_count"] = {str(k): round(float(np.mean(v)), 4) for k, v in sorted(by_c.items())}
  return out


# ----------------------------------------------------------------------------------------------------------
# Attention cost model (per query token, per CSA layer)

def attention_cost(config: ModelConfig, seq_len: int, k: int | None = None) -> dict:
  """Average over the query positions of a seq_len sequence: rows read and FLOPs of one CSA layer's attention.

  window rows = min(W, t+1); compressed rows = min(k, visible entries) (visible = (t+1)//ratio of the first index
  layer: 4 for V4 CSA, 2 for the V4.1 model); FLOPs count the
  q.k and p.v products (4 * H * d per row) plus the indexer scores over all visible index keys
  (2 * index_heads * index_dim per entry)."""
  a, ix = config.attention, config.indexer
  k = ix.topk if k is None else k
  t = np.arange(seq_len)
  plans = index_layer_plans(config)
  vis = (t + 1) // (plans[0].ratio if plans else 4)
  win = np.minimum(a.window, t + 1)
  comp = np.minimum(k, vis)
  attn_flops = 4 * a.num_heads * a.head_dim * (win + comp)
  idx_flops = 2 * ix.num_heads * ix.head_dim * vis
  dense_flops = 4 * a.num_heads * a.head_dim * (win + vis)
  last = seq_len - 1
  return dict(window_rows=float(win.mean()), compressed_rows=float(comp.mean()),
              compressed_rows_last=int(comp[last]), visible_entries_last=int(vis[last]),
              attn_flops=float(attn_flops.mean()), indexer_flops=float(idx_flops.mean()),
              total_flops=float((attn_flops + idx_flops).mean()), dense_attn_flops=float(dense_flops.mean()))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints

def save_checkpoint(params, config: ModelConfig, directory: str, meta: dict[str, Any] | None = None,
                    force: bool = True):
  os.makedirs(directory, exist_ok=True)
  save_params(jax.device_get(params), os.path.join(directory, "params"), force=force)
  info = dict(config=config_to_dict(config), num_params=count_params(params), **(meta or {}))
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(info, f, indent=1, default=str)


def load_checkpoint_dir(directory: str):
  with open(os.path.join(directory, "config.json")) as f:
    info = json.load(f)
  config = config_from_dict(info["config"])
  return config, restore_params(os.path.join(directory, "params"), config), info


def load_trained(name: str = "v4_retrieval"):
  """(config, params) of a shipped checkpoint under experiments/checkpoints/<name> (or a directory path)."""
  directory = name if os.path.isdir(name) else os.path.join(CHECKPOINT_ROOT, name)
  config, params, _ = load_checkpoint_dir(directory)
  return config, params


def task_spec_from_info(info: dict, **overrides):
  """The task a checkpoint was trained on (`tasks.KVRecallSpec` or `tasks.CountSpec`), with field overrides."""
  return dataclasses.replace(tasks.spec_from_dict(info["task"]), **overrides)


def init(config: ModelConfig, seed: int = 0):
  return init_params(config, jax.random.PRNGKey(seed))
