"""KV precision x tiers, on one device and on a mesh (2, 2, 2) of 8 host devices.

* Records carry each pool array as it is stored: an FP8 pool's e4m3 payload, UE8M0 scale bytes and bf16 RoPE part
  are three record components, never dequantized; bf16 pools stay bf16. Random raw bits (every e4m3 / bf16 pattern,
  NaNs included) go from the pool to a host and a disk tier and back into a fresh pool at other blocks, byte for
  byte; on the mesh the blocks are spread over both data shards and reload into the other shard.
* Records written at one precision never load at another (the layout fingerprint names the KV dtype).
* End to end: an engine whose small pool evicts (and so demotes) a conversation resumes it from the tiers with the
  greedy tokens of a cold engine at the same precision (fp32, bf16, FP8), on one device and on the mesh.

The mesh checks run in a child process with 8 host devices (tests/dsv4/tiers_precision_worker.py)."""


import jax
import ml_dtypes
import numpy as np
import pytest

from cache.hashing import ExtraKeys
from cache.tiers import record
from dsv4 import caches, model
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.tiering_config import TieringConfig
from tests.dsv4 import tiers_precision_worker
from tests.dsv4.test_sharding import run_worker


def run_mesh_worker(*args, timeout=1500):
  return run_worker(*args, timeout=timeout, module="tests.dsv4.tiers_precision_worker")


def test_record_manifest_names_ml_dtypes_and_round_trips_raw_bits():
  assert [record.dtype_str(d) for d in (np.float32, np.int32, np.uint8, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)] \
      == ["<f4", "<i4", "|u1", "bfloat16", "float8_e4m3fn"]
  assert record.np_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16) and record.np_dtype("<f4") == np.dtype(np.float32)
  with pytest.raises(ValueError, match="raw bytes"):
    record.np_dtype("<V2")            # what np.dtype(bfloat16).str reads back as
  rng = np.random.default_rng(0)
  arrs = [rng.integers(0, 256, (4, 64), np.uint8).view(ml_dtypes.float8_e4m3fn),
          rng.integers(0, 256, (4, 1), np.uint8),
          rng.integers(0, 1 << 16, (4, 64), np.uint16).view(ml_dtypes.bfloat16)]
  man = tuple(record.ArrayEntry(f"L0/window_kv.{n}", record.dtype_str(a.dtype), a.shape)
              for n, a in zip(("nope", "scale", "rope"), arrs))
  fp = record.Fingerprint("m", "t", "layout")
  hdr = record.RecordHeader(fp, "swa", b"d" * 16, b"p" * 16, 0, (1, 2, 3, 4), man)
  out = record.decode(record.encode(hdr, arrs), record.Expect(fp, "swa", b"d" * 16, b"p" * 16, 0, (1, 2, 3, 4), man))
  for a, b in zip(arrs, out):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
  with pytest.raises(ValueError, match="manifest says"):     # never a silent conversion into the record
    record.encode(hdr, [arrs[0].astype(np.float32)] + arrs[1:])


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_blocks_through_host_and_disk_bit_for_bit(kv, tmp_path):
  print(tiers_precision_worker.check_raw(kv, str(tmp_path)))


def test_blocks_on_a_mesh_bit_for_bit(tmp_path):
  """Pools split over `data` (2 shards, shard-local block ids): the same raw round trip, sources on both shards,
  each reloaded into the other shard; nothing else in any shard's pool changes. FP8 only (its record has every
  component dtype: e4m3, uint8, bf16, fp32); `python -m tests.dsv4.tiers_precision_worker raw fp8,bf16,fp32 DIR`
  with 8 host devices runs all three."""
  out = run_mesh_worker("raw", "fp8", str(tmp_path))
  assert out.count("bit for bit") == 1 and "shards=2" in out


def test_records_of_one_precision_never_load_at_another(tmp_path):
  cfg = tiers_precision_worker.config(False)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  toks = list(range(2, 2 + 128))
  ts = {}
  for kv in ("fp32", "bf16", "fp8"):
    tc = TieringConfig(tiers=("host",), policy="load", model_digest="m")
    ec = EngineConfig(max_num_seqs=2, max_model_len=256, num_full_blocks=4, num_swa_blocks=8,
                      layout=caches.CacheLayout(kv_dtype=tiers_precision_worker.KV[kv]), tiering=tc)
    ts[kv] = Engine(params, cfg, ec).tiering
  specs = {kv: t.specs.fingerprint for kv, t in ts.items()}
  assert len(set(specs.values())) == 3, specs

  def ident(t):
    return t._ident_of(t._hasher(ExtraKeys(), toks), t._fingerprint(ExtraKeys()), toks, caches.FULL, 0)

  idents = {kv: ident(t) for kv, t in ts.items()}
  assert len({i.key for i in idents.values()}) == 3            # another precision never even looks the key up
  w, t8 = idents["fp8"], ts["fp8"]
  data = record.encode(
      record.RecordHeader(w.fp, caches.FULL, w.digest, w.parent, w.start, w.tokens, t8.manifest[caches.FULL]),
      [np.zeros(e.shape, record.np_dtype(e.dtype)) for e in t8.manifest[caches.FULL]])
  for kv in ("fp32", "bf16"):                                  # and a record handed over anyway is refused
    i, t = idents[kv], ts[kv]
    with pytest.raises(record.RecordError, match="fingerprint"):
      record.decode(data, record.Expect(i.fp, caches.FULL, i.digest, i.parent, i.start, i.tokens,
                                        t.manifest[caches.FULL]))
  # same key and fingerprint but another manifest (FP8 components vs bf16 arrays): refused too
  i, t = idents["bf16"], ts["bf16"]
  fake = record.encode(
      record.RecordHeader(i.fp, caches.FULL, i.digest, i.parent, i.start, i.tokens, t8.manifest[caches.FULL]),
      [np.zeros(e.shape, record.np_dtype(e.dtype)) for e in t8.manifest[caches.FULL]])
  with pytest.raises(record.RecordError, match="arrays"):
    record.decode(fake, record.Expect(i.fp, caches.FULL, i.digest, i.parent, i.start, i.tokens,
                                      t.manifest[caches.FULL]))
  for t in ts.values():
    t.close()


@pytest.mark.matrix   # on demand: the composition matrix's tier rows cover it in CI
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp8"])
def test_engine_reload_same_tokens_as_cold(kv, tmp_path):
  print(tiers_precision_worker.check_engine(kv, str(tmp_path)))


@pytest.mark.matrix   # on demand (~10 min): the composition matrix's mesh tier rows cover it in CI
def test_engine_on_a_mesh_reload_same_tokens_as_cold(tmp_path):
  out = run_mesh_worker("engine", "fp32,bf16,fp8", str(tmp_path), timeout=3000)
  done = [l for l in out.splitlines() if "shards=2" in l and l.endswith(" s)")]   # one timed line per precision
  assert len(done) == 3, out
