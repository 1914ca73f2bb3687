"""The GPU suite's parts (benchmarks/gpu_suite.py runs them in one process, in this order of value):

  budget.py       the time budget and its watchdog (a fake clock in tests)
  report.py       results.jsonl (one row per item, appended as it ends) and suite.md (rewritten after each row)
  jax_compat.py   what differs between the jax lines the suite meets (0.10.x here, 0.11.x on the GPU image)
  ceilings.py     (a) versions, device-to-device copy bandwidth, bf16 matmul rate
  kernel_cases.py (b, e) the kernels at V4-Flash shapes: the fused top-k diagnosis, each kernel against its
                  reference and timed with the same compiled executable; tuning rows
  serve_job.py    (c) the main job (experiments.serve as a library call) against its stored CPU answers
  engine_width.py (d) the engine at V4-Flash attention widths: throughput, step and bookkeeping times, kernels vs
                  XLA, request alone vs batched
  plan.py         the items in order, each with the seconds it needs to start; the loop that runs them
"""
