"""A tier reload needs only the resume point's SWA tail, not a checkpoint at every boundary before it (the sparse
checkpoint placement leaves gaps: a request that hit takes dense-start checkpoints only past its full-history run,
up to its prompt / re-render boundary).

Hand case (v4_tiny: 128-token alignment = full block, 32-token swa blocks, 1-block tail; retention 0; host tier):
* X = S (150 shared tokens) + 60 own tokens, 4 answer tokens: hits nothing, takes the dense-start checkpoint 128
  (its prompt / re-render / end boundaries are all 128 too).
* Y = S + 50 own tokens (200), 190 answer tokens: hits X's 128 where its full-history run ends too; its re-render =
  prompt boundary is 128, so no dense-start point past the run (256 > 128); its end floor(389 / 128) * 128 = 384.
  So the cached checkpoints are 128 and 384, and nothing at 256.
* The device cache is dropped (everything demoted to the host tier), then Z = Y's prompt + answer + 50 tokens
  (440) arrives: no device hit, and the tiers hold full blocks [0, 384) and the swa tails of 128 and 384.
Z must resume at 384, and the 128 tail comes along as an optional record (requiring also the tail of every boundary
in (0, 384] that a request with the dense schedule would have taken, 256 included, would stop it at 128), and its
tokens / logits must equal a cold engine's."""

import dataclasses

import jax
import numpy as np

from dsv4 import config, model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, chunk_size=64, max_model_len=640, num_full_blocks=12,
                  num_swa_blocks=48, record_logits=True)


def test_reload_needs_only_the_resume_points_tail():
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(21)
  V = cfg.vocab_size
  s = [int(t) for t in rng.integers(2, V, 150)]
  x = s + [int(t) for t in rng.integers(2, V, 60)]
  y = s + [int(t) for t in rng.integers(2, V, 50)]
  assert x[150] != y[150]
  eng = Engine(params, cfg, dataclasses.replace(EC, tiering=TieringConfig(tiers=("host",), policy="load")))
  try:
    (ox,) = generate(params, cfg, [x], SamplingParams(max_tokens=4, ignore_eos=True), engine=eng)
    (oy,) = generate(params, cfg, [y], SamplingParams(max_tokens=190, ignore_eos=True), engine=eng)
    assert (ox.hit_tokens, oy.hit_tokens) == (0, 128)
    z = y + oy.output + [int(t) for t in rng.integers(2, V, 50)]
    # the device holds checkpoints at 128 and 384 only (nothing at 256)
    m = eng.cache_manager
    assert [m.lookup(z[:p + 1]).num_tokens for p in (128, 256, 384)] == [128, 128, 384]
    eng.tiering.drop_device_cache()
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    (oz,) = generate(params, cfg, [z], sp, engine=eng)
    assert oz.hit_tokens == 384, eng.tiering.decisions
    assert eng.tiering.stats["tier_hit_tokens"] == 384
    got = np.stack(oz.token_logits)
    # the optional tail at 128 (in the tier) was loaded with 384's and is a device checkpoint again; 256 was not
    assert [m.lookup(z[:p + 1]).num_tokens for p in (128, 256)] == [128, 128]
  finally:
    eng.tiering.close()
  cold = Engine(params, cfg, EC)
  (oc,) = generate(params, cfg, [z], sp, engine=cold)
  assert oz.output == oc.output
  ref = np.stack(oc.token_logits)
  assert np.max(np.abs(got - ref)) <= 1e-6 * np.max(np.abs(ref))
