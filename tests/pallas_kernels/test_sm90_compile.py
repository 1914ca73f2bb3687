"""Every Pallas-Triton kernel compiled for sm_90a on the CPU (benchmarks/sm90_compile.py): JAX's Triton module ->
pip triton (TTIR passes, TTGIR, LLVM, PTX for cuda:90) -> `ptxas -v --gpu-name sm_90a`. The slow test fails on any
compile error and on a register spill in the attention kernels or the batch-invariant matmuls; it skips, with the reason, where triton or
ptxas is missing. The default-tier tests check the ptxas report parser and the occupancy arithmetic; the lowering
itself is checked in the default tier by test_gpu_lowering.py."""

import pytest

from benchmarks import sm90_compile as sc

_PTXAS_V = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'dsv4_sparse_mla' for 'sm_90a'
ptxas info    : Function properties for dsv4_sparse_mla
    496 bytes stack frame, 1608 bytes spill stores, 1284 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 496 bytes cumulative stack size, 1024 bytes smem
ptxas info    : Compile time = 738.796 ms
"""


def test_parse_ptxas_report():
  r = sc.parse_ptxas(_PTXAS_V)
  assert r == sc.PtxasReport("dsv4_sparse_mla", 255, 496, 1608, 1284, 1024)
  with pytest.raises(ValueError):
    sc.parse_ptxas("ptxas fatal   : Unresolved extern function")


def test_ctas_per_sm_against_h200_limits():
  assert sc.ctas_per_sm(255, 112 * 1024, 256) == (1, "regs")  # 255 -> 256 a thread x 256 threads = 65536
  assert sc.ctas_per_sm(128, 100 * 1024, 256) == (2, "regs+smem")  # 32768 registers; 2 x (100 + 1) KB <= 228
  assert sc.ctas_per_sm(66, 8 * 1024, 128) == (7, "regs")  # 72 x 32 = 2304 a warp x 4 warps = 9216 -> 7
  assert sc.ctas_per_sm(32, 0, 1024) == (2, "regs+threads")
  assert sc.ctas_per_sm(16, 0, 32) == (32, "ctas")
  assert sc.ctas_per_sm(64, 228 * 1024, 128) == (0, "smem")  # above the 227 KB a CTA may have


def test_every_family_has_cases():
  fams = {c.family for c in sc.CASES}
  assert fams == {"sparse", "indexer_scores", "indexer_topk", "row_dot", "grouped_dot"}
  names = [c.name for c in sc.CASES]
  assert len(set(names)) == len(names)
  for fmt in ("bf16", "fp8_record", "fp8_paged"):
    assert {n for n in names if n.endswith(fmt) and "top2048" in n}
    assert {n for n in names if n.endswith(fmt) and "csa_top512" in n and "_b128_" in n}
  assert any("v41" in n for n in names)
  assert {n for n in names if n.startswith("grouped_dot_gate_up_e256")} and {n for n in names if "down_e256" in n}


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90a_and_attention_and_matmuls_do_not_spill(tmp_path):
  try:
    sc.find_tools()
  except sc.ToolMissing as e:
    pytest.skip(str(e))
  rows = sc.run(sc.CASES, workdir=str(tmp_path))
  errors = [(r.case, r.error) for r in rows if r.error]
  assert not errors, errors
  assert {r.case for r in rows} == {c.name for c in sc.CASES}
  spills = [(r.case, r.compiled.spill_store_bytes, r.compiled.spill_load_bytes) for r in rows
            if r.family in sc.SPILL_FAILS and r.spills]
  assert not spills, spills
  for r in rows:
    c = r.compiled
    assert c.ptx_target == "sm_90a" and c.ctas_per_sm >= 1 and c.registers <= 255, (r.case, c)
  # the bf16 sparse kernel keeps all 64 heads in one program on Hopper's wgmma
  assert all(r.compiled.mma == "wgmma" for r in rows if r.case.startswith("sparse_") and r.case.endswith("_bf16"))
