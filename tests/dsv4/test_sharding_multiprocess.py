"""Two processes x 4 CPU devices under jax.distributed (coordinator on 127.0.0.1, a free port) run the main job
(`experiments.serve`) on a (data 2, tensor 2, expert 2) mesh spanning both processes and give the same tokens as
one process on one device, prefix hits included. The test starts both processes and stops them itself."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from tests import xla_test_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 1500


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def write_requests(path, vocab):
  """Two sessions x two turns sharing a 140-token system prompt: a session's second turn (run once the first has
  finished) extends its history, so its prompt is a prefix hit."""
  rng = np.random.default_rng(0)
  system = rng.integers(3, vocab, 140).tolist()
  with open(path, "w") as f:
    for wave in range(2):
      for s in range(2):
        new = (system if wave == 0 else []) + rng.integers(3, vocab, 10 + 5 * s).tolist()
        f.write(json.dumps({"id": f"s{s}.t{wave}", "session": f"s{s}", "prompt": new,
                            "max_tokens": 4, "ignore_eos": True}) + "\n")


def read_outputs(out_dir):
  with open(os.path.join(out_dir, "outputs.jsonl")) as f:
    return [json.loads(line) for line in f]


def serve_cmd(reqs, out_dir, *extra):
  return [sys.executable, "-m", "experiments.serve", "--model=random", "--preset=v4_tiny",
          f"--requests={reqs}", f"--out_dir={out_dir}", "--compilation_cache_dir=", "--max_num_seqs=4",
          "--chunk_size=64", *extra]


def test_two_processes_same_tokens_as_one(tmp_path):
  from dsv4 import config
  reqs = str(tmp_path / "reqs.jsonl")
  write_requests(reqs, config.v4_tiny().vocab_size)
  env = dict(xla_test_flags.child_env(), PYTHONPATH=ROOT)  # no device-count flag: serve sets its own
  port = free_port()
  mp = ["--mesh=data:2,tensor:2,expert:2", "--num_cpu_devices=4", f"--coordinator=127.0.0.1:{port}",
        "--num_processes=2"]
  procs = [subprocess.Popen(serve_cmd(reqs, str(tmp_path / f"p{i}"), *mp, f"--process_id={i}"), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    single = subprocess.run(serve_cmd(reqs, str(tmp_path / "one")), cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=TIMEOUT_S)
    assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-2000:]
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
  finally:
    for p in procs:     # never leave a process (or the coordinator port) behind
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  one = read_outputs(tmp_path / "one")
  assert sum(o["hit_tokens"] for o in one) > 0, "the trace must exercise prefix hits"
  for i in range(2):
    got = read_outputs(tmp_path / f"p{i}")
    assert [(o["id"], o["output"], o["hit_tokens"]) for o in got] == \
           [(o["id"], o["output"], o["hit_tokens"]) for o in one], f"process {i}"
    with open(tmp_path / f"p{i}" / "metrics.json") as f:
      assert json.load(f)["process"] == [i, 2]
