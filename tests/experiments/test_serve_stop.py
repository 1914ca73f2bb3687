"""Stop strings stop generation in `python -m experiments.serve --checkpoint=DIR` (a release checkpoint with a
tokenizer): a request ends at the step whose token completes one of its stop strings (finish_reason "stop", the
output up to and including that token, the text cut before the string), instead of running on to max_tokens; and
--dtype=fp32 on a bf16 checkpoint really computes in fp32."""

import json
import os
import subprocess
import sys

import pytest

from tests.dsv4.test_loading_pretrained import make_checkpoint_dir
from tests.dsv4.test_tokenizer import make_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "w10 w11 w12"
N = 24
# Word prefixes: each matches many of the 505 words, so most of them show up within N greedy tokens of a random
# model; a request whose stop string never shows runs to max_tokens like the reference.
STOPS = [f"w{d}" for d in range(1, 10)] + ["4 w", "never-there"]     # "4 w" spans two words


@pytest.mark.slow      # a minute of compiles on 2 cores; the hook's own test in test_serve_flags.py stays fast
def test_stop_strings_end_generation_at_the_completing_token(tmp_path):
  ckpt = tmp_path / "ckpt"
  make_checkpoint_dir(ckpt, "saved")                       # bf16 shards + tokenizer
  reqs = [{"id": "ref", "prompt": PROMPT, "max_tokens": N, "ignore_eos": True}]
  reqs += [{"id": f"s{i}", "prompt": PROMPT, "max_tokens": N, "ignore_eos": True, "stop": [s]}
           for i, s in enumerate(STOPS)]
  (tmp_path / "reqs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reqs))
  out = tmp_path / "out"
  p = subprocess.run([sys.executable, "-m", "experiments.serve", f"--checkpoint={ckpt}",
                      f"--requests={tmp_path / 'reqs.jsonl'}", f"--out_dir={out}", "--dtype=fp32",
                      f"--max_num_seqs={len(reqs)}", "--max_num_batched_tokens=64", "--chunk_size=32",
                      "--max_model_len=256", "--num_full_blocks=8", "--num_swa_blocks=32"],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stderr[-3000:]
  metrics = json.loads((out / "metrics.json").read_text())
  assert metrics["dtype"] == "fp32"                        # what was loaded, not the shards' bf16
  rows = {d["id"]: d for d in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
  tok = make_tokenizer(512)
  ref = rows["ref"]["output"]
  assert len(ref) == N and rows["ref"]["finish_reason"] == "length"
  stopped = 0
  for i, s in enumerate(STOPS):
    r = rows[f"s{i}"]
    # the first k whose decoded prefix holds the stop string: generation must end right there
    k = next((k for k in range(1, N + 1) if s in tok.decode(ref[:k])), None)
    if k is None:
      assert r["output"] == ref and r["finish_reason"] == "length" and "stop" not in r, (s, r)
      continue
    stopped += 1
    text = tok.decode(ref[:k])
    assert r["output"] == ref[:k], (s, r["output"], ref)
    assert r["finish_reason"] == "stop" and r["stop"] == s and r["text"] == text[: text.find(s)], (s, r)
  assert stopped >= 3, rows                                # the check above ran on real stops
  assert metrics["summary"]["generated_tokens"] < N * len(reqs)
