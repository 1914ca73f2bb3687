"""Where the fused top-k goes wrong on a GPU, alone (the GPU suite runs the same diagnosis as its section (b) rows:
benchmarks/suite/kernel_cases.py, `TopkDiagnosis`). Each row: err/tol of `dispatch._topk_err` for one variant of
the failing decode case (B=64, M=32768, k=512, bf16 keys), whether two runs on the same inputs agree, the ids the
kernel never wrote (sentinel) and the selected lanes per row against the visible entries.

  python -m benchmarks.probes.topk_gpu_diag            # on the GPU
  python -m benchmarks.probes.topk_gpu_diag --dry      # CPU plumbing (interpret mode, B=2)

Reading it: `kernel_cases.topk_variants` says what each variant rules in or out.
"""

from absl import app, flags

from benchmarks.suite.kernel_cases import TopkDiagnosis

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_bool("dry", False, "CPU plumbing: interpret mode, B=2")
  flags.DEFINE_string("only", "", "comma-separated variant names (default: all)")
  flags.DEFINE_integer("seed", 0, "seed of the inputs")


def main(argv):
  del argv
  a = FLAGS
  diag = TopkDiagnosis(a.dry, a.seed)
  if a.only:
    diag.variants = {k: v for k, v in diag.variants.items() if k in a.only.split(",")}
  for name, fut in diag.compile(threads=4).items():
    try:
      r = diag.run_variant(name, *fut.result())
      print(f"{name:10s} err/tol={r['err_over_tol']:<10.4g} neg_ids={r['neg_ids']:<6d} sentinel={r['sentinel_ids']:<5d} "
            f"bad_rows={r['bad_rows']} lanes_min={r['lanes_selected_min']}/{r['lanes_expected']} "
            f"repeat_differs={r['repeat_differs']} (compile {r['compile_s']:.1f} s)", flush=True)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row, not the end
      print(f"{name:10s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
