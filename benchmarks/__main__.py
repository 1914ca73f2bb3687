"""`python -m benchmarks`: what each benchmark measures and the command that produces its table.

Dependency-light on purpose (no jax import): it only prints. Each script's docstring says how to read its numbers;
`python -m benchmarks.<name> --help` lists its flags. Run everything from the repository root. CPU timings on a
shared machine are noisy: read the ratios measured within one run.
"""

from __future__ import annotations

# name -> [(what it measures, canonical command)]: the first row is the benchmark's main number (the command
# BUILD_NOTES.md quotes), the others are its modes.
MAINTAINED = [
    ("model_vs_hf", [
        ("this model vs transformers, same weights: logits agree?, prefill tok/s, decode ms, roofline",
         "python -m benchmarks.model_vs_hf --configs=wide --decode_steps=4 --repeats=2"),
        ("  same, tiny oracle config too", "python -m benchmarks.model_vs_hf")]),
    ("step_bench", [
        ("engine step cost vs live context and real tokens (decode, mixed, memory), and beside a plain step",
         "python -m benchmarks.step_bench --repeats=3"),
        ("  the step (batch invariant) vs a plain step, v4_tiny and a wide MoE config",
         "python -m benchmarks.step_bench --parts=invariant --repeats=5"),
        ("  mixed step (chunk + 63 decodes) vs the chunk alone, per chunk size",
         "python -m benchmarks.step_bench --parts=mixed --mixed_chunks=64,256,512 --repeats=5")]),
    ("step_roofline", [
        ("roofline of one step at V4-Flash / V4.1-Flash width on an H200: tiled invariant vs row-invariant vs "
         "plain step, weight / KV / activation bytes, FLOPs, ratios; GPU check kernel rows beside the model",
         "python -m benchmarks.step_roofline"),
        ("  same on an H100 with FP8 experts and FP8 KV records",
         "python -m benchmarks.step_roofline --device=h100 --experts=fp8 --kv=fp8")]),
    ("engine_bench", [
        ("TTFT of a resumed session with / without prefix reuse; batched vs one-by-one throughput",
         "python -m benchmarks.engine_bench")]),
    ("cache_bench", [
        ("KV cache bookkeeping per engine step as the engine pays it (marginal time of the fused step + the "
         "admission call) vs vLLM 0.33's KVCacheManager at its engine defaults, same trace",
         "python -m benchmarks.cache_bench --vllm_src=DIR"),
        ("  same, 8 x 2k at 4k and 65k blocks only (~2 min, mostly compiles)",
         "python -m benchmarks.cache_bench --small --vllm_src=DIR"),
        ("  cost of one standalone jitted call with both pools donated (the floor under add_requests)",
         "python -m benchmarks.cache_bench --call_floor --pools 4096,65536,262144"),
        ("  hit tokens under a fixed KV byte budget, v1 vs v2 checkpoint placement",
         "python -m benchmarks.cache_bench --budget --budgets_gib 0.375,0.5,0.75,1")]),
    ("kernels_bench", [
        ("Pallas kernels vs XLA references, all cases in one process: correct?, then ms, TFLOP/s, GB/s (GPU)",
         "python -m benchmarks.kernels_bench"),
        ("  CPU interpret-mode smoke run (numbers meaningless)", "python -m benchmarks.kernels_bench --small"),
        ("  the sparse decode's predicted roofline per batch and pool format (docs/kernels.md)",
         "python -m benchmarks.kernels_bench --roofline")]),
    ("gpu_suite.sh", [
        ("the GPU suite, one process under a 510 s budget: ceilings, the fused top-k diagnosis, every kernel vs its "
         "reference at V4-Flash shapes (timed), the main job, the engine at V4-Flash widths, tuning rows",
         "bash benchmarks/gpu_suite.sh OUT_DIR"),
        ("  CPU dry run of every item (tests/test_gpu_suite.py, slow tier)",
         "bash benchmarks/gpu_suite.sh OUT_DIR --dry_run"),
        ("  the items, in order of value", "python -m benchmarks.gpu_suite --list")]),
    ("sm90_compile", [
        ("every Pallas-Triton kernel compiled for sm_90a on the CPU (pip triton + ptxas): registers, spills, shared "
         "memory, CTAs per SM", "python -m benchmarks.sm90_compile [--only SUBSTR,...]")]),
    ("sizing", [
        ("V4-Flash / V4.1-Flash bytes per device on a mesh: params, KV pools, fits?",
         "python -m benchmarks.sizing --aot_layers=-1 --batch=32 --context=131072"),
        ("  + activations from the AOT-compiled step (slow on the CPU)", "python -m benchmarks.sizing")]),
    ("compile_bench", [
        ("XLA CPU compile cost of the model's forward (CPU s, optimized HLO lines)",
         "python -m benchmarks.compile_bench")]),
]

# name -> one-line question (benchmarks/probes/README.md has the commands with their flags)
PROBES = [
    ("cache_waves_vllm", "the hits vLLM 0.33 gives the cold waves / document fan-out of tests/cache/test_scenarios.py"),
    ("cpu_inplace", "what writing rows into a 16-bit pool costs on XLA's CPU (why the CPU goes through bit patterns)"),
    ("cumsum_cpu", "whether a running sum costs O(n^2) in the cache's CPU programs (why release chunk width matters little)"),
    ("decode_bench", "model decode step vs context with three indexer paths (paged, dense reference, no score)"),
    ("decode_profile", "where a wide-config decode step spends its time, per XLA CPU thunk"),
    ("defer_ttft", "cost of in-batch shared-prefix deferral in time-to-first-token (engine steps)"),
    ("kv_latent_split", "shared K = V latent under tensor parallelism: replicated vs feature-split"),
    ("load_memory", "host memory while streaming a sharded checkpoint in, vs the largest shard"),
    ("map_count_probe", "memory maps held by live XLA CPU executables; the vm.max_map_count crash"),
    ("nnx_apply_overhead", "cost of nnx_model.apply next to model.forward (jaxprs, trace and step time)"),
    ("step_profile", "where an engine step holding few tokens spends CPU time per XLA thunk: pools, budget, loops"),
    ("step_faults", "page faults a CPU step takes on scratch mapped fresh every step, with the engine's allocator "
     "setting and at glibc's defaults"),
    ("topk_gpu_diag", "where the fused top-k goes wrong on a GPU: race, selection, merge or across warps"),
]

# Benchmarks that live outside benchmarks/ (they write results files next to their tables).
ELSEWHERE = [
    ("tiers_workload", "KV tiers (host / disk / Redis / Mooncake): sessions beyond the device pool; resume TTFT "
     "per tier vs recompute", "python -m experiments.tiers_workload"),
]


def _table(headers, rows):
  widths = [max(len(str(r[i])) for r in [headers] + rows) for i in range(len(headers))]
  line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
  return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def main() -> None:
  print("Maintained benchmarks (each prints markdown tables; `--help` for flags):\n")
  rows = []
  for name, entries in MAINTAINED:
    rows += [[name if i == 0 else "", what, cmd] for i, (what, cmd) in enumerate(entries)]
  print(_table(["benchmark", "what it measures", "command"], rows))
  print("\nProbes (one-off investigations, kept runnable: python -m benchmarks.probes.<name>; "
        "benchmarks/probes/README.md):\n")
  print(_table(["probe", "question", "command"], [[n, q, f"python -m benchmarks.probes.{n}"] for n, q in PROBES]))
  print("\nElsewhere (experiments/):\n")
  print(_table(["benchmark", "what it measures", "command"], [list(r) for r in ELSEWHERE]))


if __name__ == "__main__":
  main()
