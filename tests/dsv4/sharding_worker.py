"""Checks that need several devices, run in a subprocess by tests/dsv4/test_sharding*.py (the rest of the suite
runs on one device, and the host device count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.sharding_worker forward v4
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.sharding_worker engine

Exits non-zero (with the failing numbers) on any mismatch; prints one line per check.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, model, sharding
from dsv4 import config as C

MESHES = [(8, 1, 1), (1, 1, 8), (2, 2, 2), (1, 8, 1)]   # (data, tensor, expert)
MESHES_V41 = [(2, 2, 2), (1, 8, 1)]  # what differs from V4 (CSA2 heads, Engram tables) splits on these
RTOL = 1e-5


def wide(cfg: C.ModelConfig) -> C.ModelConfig:
  """Tiny config with enough heads, output groups and experts to split 8 ways."""
  return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, num_heads=8, o_groups=8),
                             moe=dataclasses.replace(cfg.moe, n_routed_experts=16))


def config_for(variant: str) -> C.ModelConfig:
  return wide(C.v4_tiny() if variant == "v4" else C.v41_tiny())


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_forward(variant: str, meshes=MESHES, kv_latent="replicated") -> None:
  """Prefill of 40 tokens (lengths differ per row) then one decode step, sharded vs one device."""
  cfg = config_for(variant)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  B, T = 8, 40
  layout = caches.CacheLayout()
  toks = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, cfg.vocab_size), np.int32)
  lengths = np.asarray([T - 3 * (b % 4) for b in range(B)], np.int32)
  _, swa, full = caches.init_contiguous(cfg, B, T + 8, layout)

  def idx(start, num):
    return caches.BatchIndex(np.asarray(start, np.int32), np.asarray(num, np.int32), swa, full)

  prefill = (toks[:, :T], idx(np.zeros(B), lengths))
  decode = (toks[np.arange(B), lengths][:, None], idx(lengths, np.ones(B)))
  cache = caches.init_cache(cfg, layout, swa.size, full.size)
  cache, ref_a = model.forward_jit(params, cfg, jnp.asarray(prefill[0]), cache, prefill[1], layout)
  cache, ref_b = model.forward_jit(params, cfg, jnp.asarray(decode[0]), cache, decode[1], layout)
  valid = np.arange(T)[None, :] < lengths[:, None]
  ref_a = np.where(valid[..., None], np.asarray(ref_a), 0)
  for shape in meshes:
    mesh = sharding.make_mesh(shape)
    rules = sharding.Rules(kv_latent=kv_latent)
    call, sh = sharding.jit_forward(cfg, mesh, rules, layout=layout, batch=B, num_swa_blocks=swa.size,
                                    num_full_blocks=full.size)
    p = sharding.put(params, sh["params"])
    c = sharding.put(caches.init_cache(cfg, layout, swa.size, full.size), sh["cache"])
    c, out_a = call(p, sharding.put(prefill[0], sh["tokens"]), c, sharding.put(prefill[1], sh["index"]))
    c, out_b = call(p, sharding.put(decode[0], sh["tokens"]), c, sharding.put(decode[1], sh["index"]))
    ea = rel_err(np.where(valid[..., None], np.asarray(out_a), 0), ref_a)
    eb = rel_err(out_b, ref_b)
    n_split = sum(1 for s in jax.tree_util.tree_leaves(sh["params"]) if not s.is_fully_replicated)
    print(f"forward {variant} mesh(data,tensor,expert)={shape} kv_latent={kv_latent} prefill rel {ea:.2e} "
          f"decode rel {eb:.2e} split params {n_split}", flush=True)
    if not (ea <= RTOL and eb <= RTOL):
      sys.exit(f"FAIL forward {variant} {shape}: rel errors {ea}, {eb} > {RTOL}")
    if n_split == 0 and shape != (8, 1, 1):
      sys.exit(f"FAIL forward {variant} {shape}: nothing was sharded")


def chat_workload(vocab: int):
  from dsv4.engine import workloads
  return workloads.chat(vocab, sessions=2, turns=2, system_len=140, seed=0)


def engine_config():
  from dsv4.engine.engine import EngineConfig
  return EngineConfig(max_num_seqs=4, max_num_batched_tokens=96, chunk_size=32, max_model_len=1024,
                      num_full_blocks=48, num_swa_blocks=160, record_logits=True)


def check_engine(shape=(2, 2, 2)) -> None:
  """Engine on a mesh gives the same tokens as on one device, prefix hits included."""
  from dsv4.engine.api import run_workload
  from dsv4.engine.engine import Engine
  cfg = wide(C.v4_tiny())
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  wl = chat_workload(cfg.vocab_size)
  e1 = Engine(params, cfg, engine_config())
  r1 = run_workload(e1, wl)
  e2 = Engine(params, cfg, engine_config(), mesh=sharding.make_mesh(shape))
  r2 = run_workload(e2, wl)
  hits = r2.summary()["prefix_hit_tokens"]
  worst = 0.0
  for a, b in zip(r1.outputs, r2.outputs):
    if a.output != b.output or a.error or b.error:
      sys.exit(f"FAIL engine {shape}: {a.rid} one device {a.output} vs mesh {b.output} ({a.error}, {b.error})")
    worst = max(worst, rel_err(np.stack(e2.requests[b.rid].token_logits), np.stack(e1.requests[a.rid].token_logits)))
  print(f"engine mesh={shape} requests {len(r1.outputs)} same tokens; prefix hit tokens {hits} "
        f"(one device {r1.summary()['prefix_hit_tokens']}); worst logit rel {worst:.2e}", flush=True)
  if hits == 0 or hits != r1.summary()["prefix_hit_tokens"]:
    sys.exit(f"FAIL engine {shape}: prefix hits {hits} vs {r1.summary()['prefix_hit_tokens']}")
  if worst > RTOL:
    sys.exit(f"FAIL engine {shape}: logits rel {worst}")


if __name__ == "__main__":
  what = sys.argv[1]
  if jax.device_count() < 8:
    sys.exit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  if what == "forward":
    check_forward(sys.argv[2], meshes=MESHES if sys.argv[2] == "v4" else MESHES_V41,
                  kv_latent=sys.argv[3] if len(sys.argv) > 3 else "replicated")
  elif what == "forward_feature":
    check_forward(sys.argv[2], meshes=[(2, 2, 2)], kv_latent="feature")
  elif what == "engine":
    check_engine()
  else:
    sys.exit(f"unknown check {what!r}")
  print("OK")
