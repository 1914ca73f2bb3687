"""The step cost model at real width (benchmarks/support/step_cost.py, benchmarks/step_roofline.py): hand-counted
bytes on the tiny V4, the invariants the three designs must keep at V4-Flash width, and the script's table."""

import math

import numpy as np
import pytest

from benchmarks import step_roofline
from benchmarks.support import step_cost as sc
from dsv4.config import v4_flash, v4_tiny

FP4 = 0.5 + 1 / 32
FP8_V4 = 1 + 1 / (128 * 128)


@pytest.fixture(scope="module")
def flash():
  cfg = v4_flash()
  return cfg, sc.model_weights(cfg)


def test_expected_experts_by_hand():
  assert sc.expected_touched(8, 2, 1) == pytest.approx(2.0)
  # one 64-token tile of V4-Flash touches ~200 of 256 experts (the issue's count); 2048 tokens touch nearly all
  assert sc.expected_touched(256, 6, 64) == pytest.approx(256 * (1 - (250 / 256) ** 64))
  assert 195 < sc.expected_touched(256, 6, 64) < 205
  assert sc.expected_touched(256, 6, 2048) == pytest.approx(256, rel=1e-6)
  # one token: k experts with one row each -> k row blocks; blocks as wide as the pass -> one per touched expert
  assert sc.expected_row_blocks(8, 2, 1, 16) == pytest.approx(2.0)
  assert sc.expected_row_blocks(256, 6, 40, 64) == pytest.approx(sc.expected_touched(256, 6, 40))
  # the mean number of rows is tokens * k; blocks of 1 row count rows
  assert sc.expected_row_blocks(16, 3, 50, 1) == pytest.approx(150.0)


def test_tiny_weights_by_hand():
  cfg = v4_tiny()
  w = sc.model_weights(cfg)
  D, I = 64, 32
  lw = w.layers[0]
  assert lw.expert_bytes == pytest.approx(3 * D * I * FP4)
  assert lw.shared_bytes == pytest.approx(3 * D * I * FP8_V4)
  mm = {m.name: m for m in lw.matmuls}
  assert (mm["attn/wq_a"].K, mm["attn/wq_a"].N, mm["attn/wq_a"].bytes) == (64, 32, pytest.approx(64 * 32 * FP8_V4))
  assert (mm["attn/wo_a"].groups, mm["attn/wo_a"].K, mm["attn/wo_a"].N) == (2, 128, 16)
  assert mm["hc_attn/fn"].bytes == 4 * D * 24 * 4                     # fp32
  assert lw.lookup_row_bytes == 2 * 4                                # tid2eid row: k int32 ids (layer 0 hashes)
  assert w.lm_head.bytes == D * 512 * 2 and w.embed_row_bytes == D * 2
  # MXFP4 -> FP8 experts: only the expert bytes move
  w8 = sc.model_weights(cfg, sc.Formats(experts="fp8"))
  assert w8.layers[0].expert_bytes == pytest.approx(3 * D * I * FP8_V4)
  assert w8.total_bytes - w.total_bytes == pytest.approx(4 * 8 * 3 * D * I * (FP8_V4 - FP4))


def test_tiny_csa_layer_kv_bytes_by_hand():
  cfg = v4_tiny()                    # window 16, d 64 (bf16 rows 128 B), CSA m=4 top-8, index keys 32 wide
  plan = cfg.layer_plan()[1]
  assert plan.kind == "csa"
  t = sc._attention_layer(sc.H200, sc.Formats(), sc.Tiling(), "plain", cfg, plan, 1, np.array([64]))
  reads = (16 + 8) * 128 + 16 * 64                 # window + top-8 of floor(65/4) = 16 entries; 16 index keys
  writes = 128 + 2 * 2 * (2 * 64) * 4 + 2 * 2 * (2 * 32) * 4   # window row; both compressors' fp32 fold state
  assert t.kv_bytes == reads + writes
  # attention FLOPs: 4 heads x 24 keys x (64 + 64) x 2; indexer: 8 heads x 32 x 16 keys x 2
  assert t.flops == 2 * 4 * 24 * 128 + 2 * 8 * 32 * 16
  # one token at position 67 closes entry 16 (positions 64..67): one compressed row and one index key written
  t2 = sc._attention_layer(sc.H200, sc.Formats(), sc.Tiling(), "plain", cfg, plan, 1, np.array([67]))
  assert t2.kv_bytes - t.kv_bytes == 128 + 64 + 64            # + entry row + index key; top-8 / 17 keys: +1 key


def test_tiny_decode_weights_by_hand():
  cfg = v4_tiny()
  w = sc.model_weights(cfg)
  got = sc.step_cost(cfg, sc.Point("decode", 1, 100), "plain", weights=w).tally.weight_bytes
  want = w.lm_head.bytes + sum(m.bytes for m in w.top_matmuls)
  for lw in w.layers:     # one token: its k = 2 experts, the shared one, every dense weight, one lookup row
    want += sum(m.bytes for m in lw.matmuls) + 2 * lw.expert_bytes + lw.shared_bytes + lw.other_bytes
    want += lw.lookup_row_bytes
  assert got == pytest.approx(want)


POINTS = [sc.Point("decode", b, c) for c in (8192, 65536) for b in sc.DECODE_BATCHES] + [
    sc.Point("prefill", 512, 8192)]


def test_flash_inventory_matches_the_stored_checkpoint(flash):
  """156.0 GB as stored (BUILD_NOTES.md, Sizing); a pass touching every expert reads all of it but the embedding
  table (one row per token) and the hash layers' tid2eid tables."""
  cfg, w = flash
  assert w.total_bytes / 1e9 == pytest.approx(156.0, abs=0.05)
  every = sc.step_cost(cfg, sc.Point("prefill", 8192, 8192), "plain", weights=w).tally.weight_bytes
  tables = w.embed_row_bytes * cfg.vocab_size + 3 * cfg.vocab_size * 6 * 4
  assert every == pytest.approx(w.total_bytes - tables + 3 * 8192 * 6 * 4, rel=1e-4)


def test_designs_keep_their_invariants_at_flash_width(flash):
  cfg, w = flash
  res = {(p, d): sc.step_cost(cfg, p, d, weights=w) for p in POINTS for d in sc.DESIGNS}
  for p in POINTS:
    plain = res[p, "plain"].tally
    assert res[p, "invariant"].tally.weight_bytes == pytest.approx(plain.weight_bytes)
    assert res[p, "invariant_splitk"].tally.weight_bytes == pytest.approx(plain.weight_bytes)
    assert res[p, "tiled"].tally.weight_bytes >= plain.weight_bytes * (1 - 1e-12)
    assert res[p, "invariant_splitk"].time_s <= res[p, "invariant"].time_s * (1 + 1e-9)
    assert res[p, "plain"].time_s <= min(res[p, d].time_s for d in sc.DESIGNS) * (1 + 1e-9)
  for c in (8192, 65536):
    decodes = [sc.Point("decode", b, c) for b in sc.DECODE_BATCHES]
    for d in sc.DESIGNS:
      t = [res[p, d].time_s for p in decodes]
      wb = [res[p, d].tally.weight_bytes for p in decodes]
      assert t == sorted(t) and wb == sorted(wb), d
    # one full tile is one pass; two tiles read the touched experts twice
    b64, b128 = sc.Point("decode", 64, c), sc.Point("decode", 128, c)
    assert res[b64, "tiled"].tally.weight_bytes == pytest.approx(res[b64, "plain"].tally.weight_bytes)
    assert res[b128, "tiled"].passes == 2


def test_the_issue_counts(flash):
  """A 2048-token prefill chunk in 64-token tiles: ~24x the weight traffic of one pass, ~11x its roofline time."""
  cfg, w = flash
  p = sc.Point("prefill", 2048, 8192)
  a, c = (sc.step_cost(cfg, p, d, weights=w) for d in ("tiled", "plain"))
  assert a.passes == 32
  assert 20 < a.tally.weight_bytes / c.tally.weight_bytes < 28
  assert 9 < a.time_s / c.time_s < 13
  assert c.bound == "TC" and 0.06 < c.time_s < 0.1


def test_op_time_takes_the_faster_split():
  dev = sc.H200
  t1, _, _ = sc.op_time(dev, "bf16", 1e6, 0.0, 1)
  assert t1 == pytest.approx(1e6 / (dev.hbm_bytes_per_s / dev.num_sms))
  t, moved, mem = sc.op_time(dev, "bf16", 1e6, 0.0, 1, max_pieces=132, partial_bytes_per_piece=100.0)
  assert mem and moved == 1e6 and t == pytest.approx(1e6 / dev.hbm_bytes_per_s)   # partials stay in L2


def test_script_prints_both_tables(capsys):
  flags = step_roofline.FLAGS
  flags(["step_roofline", "--models=v4_tiny"])
  try:
    step_roofline.main([])
  finally:
    flags.unparse_flags()
  out = capsys.readouterr().out
  assert "v4_tiny: one step, roofline" in out and "GPU check kernel rows" in out
  rows = [l for l in out.splitlines() if l.startswith("| decode") or l.startswith("| prefill")]
  assert len(rows) == len(sc.default_points())
  for m in sc.MEASURED_H200:
    assert m.case in out
  assert not any(math.isnan(float(c)) for l in rows for c in l.split("|")[2:7] if c.strip())
