"""The child process of `dispatch.validate`: reads one pickled validation payload on stdin (op, kernel by importable
name, tuning, the small case's abstract arguments, static arguments, seed), runs the kernel and its XLA reference
(`dispatch.child_check`) and prints one result line, `dsv4-validation-result:{"err": max error / tolerance}` or
`{"error": "..."}`. It is its own process so that a kernel that faults the GPU, aborts or hangs takes only this
process down (the parent kills it on timeout)."""

import json
import pickle
import sys

from pallas_kernels import dispatch


def main() -> int:
  payload = pickle.loads(sys.stdin.buffer.read())
  try:
    res = {"err": dispatch.child_check(payload)}
  except Exception as e:  # noqa: BLE001 - any failure is the verdict, reported in one line
    res = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:300]}
  print(dispatch._RESULT_MARK + json.dumps(res), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
