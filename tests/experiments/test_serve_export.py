"""The README's `--checkpoint` path on a fresh clone: `experiments.export_checkpoint` writes the shipped model as a
release directory, and `experiments.serve --checkpoint=DIR` answers recall questions asked as text and as chats."""

import json
import os
import subprocess
import sys

from experiments import tasks, train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
  proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


def test_exported_checkpoint_serves_text_and_chat_requests(tmp_path):
  ckpt, out = tmp_path / "v4_release", tmp_path / "out"
  assert "wrote" in _run("experiments.export_checkpoint", "--model=v4_retrieval", f"--out={ckpt}").stdout
  from dsv4.loading.tokenizer import Tokenizer
  tok = Tokenizer.from_dir(str(ckpt))
  _, _, info = train_lib.load_checkpoint_dir(os.path.join(ROOT, "experiments", "checkpoints", "v4_retrieval"))
  spec = train_lib.task_spec_from_info(info)
  batch = tasks.make_kv_batch(spec, tasks.EVAL_SEED_BASE, 3)
  q0 = spec.seq_len - spec.query_len
  reqs = []
  for row in range(3):
    t = batch["tokens"][row].tolist()
    words = tok.decode(t, skip_special_tokens=False).split(" ")       # words[0] is <bos>: the tokenizer adds it
    reqs.append({"id": f"text{row}", "prompt": " ".join(words[1:q0 + 2]), "max_tokens": 1,
                 "expected": [t[q0 + 2]]})
    reqs.append({"id": f"chat{row}", "max_tokens": 1, "expected": [t[q0 + 4]],
                 "messages": [{"role": "system", "content": " ".join(words[1:q0])},
                              {"role": "user", "content": words[q0 + 1]},
                              {"role": "assistant", "content": words[q0 + 2]},
                              {"role": "user", "content": words[q0 + 3]}]})
  path = tmp_path / "reqs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
  proc = _run("experiments.serve", f"--checkpoint={ckpt}", f"--requests={path}", f"--out_dir={out}")
  assert "wrote" in proc.stdout
  rows = {r["id"]: r for r in map(json.loads, open(out / "outputs.jsonl"))}
  assert set(rows) == {r["id"] for r in reqs}
  assert all(r["error"] is None and r["correct"] for r in rows.values()), rows
  assert all(r["text"].startswith("v") for r in rows.values())             # a value word, decoded by the tokenizer
  summary = json.load(open(out / "metrics.json"))["summary"]
  assert summary["accuracy"] == 1.0 and summary["errors"] == 0
