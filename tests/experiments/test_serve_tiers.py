"""KV tiers a user can reach through `python -m experiments.serve`: with --kv_tier_write=store (the default) every
block is written to the tiers as it is registered, so a SECOND process on the same disk directory (or Redis store)
loads the shared document instead of recomputing it, with the same answers; a process killed with SIGKILL midway
leaves behind what it stored (and the answers it finished, in outputs.jsonl), which a rerun reloads; a store that is
unreachable at start-up or lost midway is one warning line and the run goes on without it (exit code 2 with
--kv_tiers_strict); --kv_tier_write=evict writes only what the device evicts.

The workload: two recall sessions of two turns each over one 256-token document (the shipped v4_retrieval model's
own task, graded), from a --requests file. All runs share one persistent compilation cache, so only the first one
compiles."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.store_servers import require_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _requests(long_turn: bool = False) -> list[dict]:
  from experiments import task_workloads, tasks
  wl = task_workloads.recall_sessions(tasks.KVRecallSpec(), documents=1, revisions=0, sessions_per_doc=2, turns=2)
  reqs = [{"prompt": list(t.new_tokens), "max_tokens": 1, "ignore_eos": True, "session": t.session,
           "expected": list(t.expected)} for wave in wl.waves for t in wave]
  if long_turn:       # a third turn that decodes for a long time: the process is still running when it is killed
    reqs.append({"prompt": [3], "max_tokens": 1500, "ignore_eos": True, "session": reqs[0]["session"]})
  return reqs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  d = tmp_path_factory.mktemp("serve_tiers")
  for name, long_turn in (("small", False), ("killed", True)):
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _requests(long_turn)))
  (d / "one.jsonl").write_text(json.dumps({"prompt": [0, 3, 4, 5, 6], "max_tokens": 1}) + "\n")
  return d


def _cmd(files, out, *args):
  xla = os.environ.get("DSV4_TEST_XLA_CACHE_DIR") or files / "xla"     # the test run's own cache, when there is one
  return [sys.executable, "-m", "experiments.serve", f"--out_dir={out}", f"--compilation_cache_dir={xla}", *args]


def serve(files, out, *args, reqs="small"):
  p = subprocess.run(_cmd(files, out, f"--requests={files / (reqs + '.jsonl')}", *args), cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
  return p


def outputs(out):
  return [json.loads(l) for l in open(os.path.join(out, "outputs.jsonl"))]


def summary(out):
  return json.load(open(os.path.join(out, "metrics.json")))["summary"]


def answers(out):
  return [(o["id"], o["output"], o["correct"]) for o in outputs(out)]


@pytest.fixture(scope="module")
def cold(files):
  """The first process: an empty disk directory, so everything is computed (and stored)."""
  serve(files, files / "cold", "--kv_tiers=disk", f"--kv_disk_dir={files / 'disk'}")
  s = summary(files / "cold")
  assert s["tier_hit_tokens"] == 0 and s["disk_bytes_written"] > 0 and s["accuracy"] == 1.0
  return files / "cold"


def _records(d) -> int:
  return sum(n.endswith(".rec") for n in os.listdir(d)) if os.path.isdir(d) else 0


def test_a_second_process_reloads_the_first_ones_disk_records(files, cold):
  assert _records(files / "disk") >= 2           # written at registration (--kv_tier_write=store), not at eviction
  serve(files, files / "warm", "--kv_tiers=disk", f"--kv_disk_dir={files / 'disk'}")
  s = summary(files / "warm")
  assert s["tier_hit_tokens"] > 0 and s["disk_hit_tokens"] > 0 and s["disk_failures"] == 0
  assert answers(files / "warm") == answers(cold) and s["accuracy"] == summary(cold)["accuracy"]
  first = outputs(files / "warm")[0]
  assert first["tier_hit_tokens"] >= 128 and first["line"] == 1     # the document came off the disk


def test_an_unreachable_store_is_one_warning_and_the_run_goes_on(files):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"     # bound, not listening: refused
    # evict mode on the disk tier beside it: nothing is evicted from the device in this run, so nothing is written
    p = serve(files, files / "down", "--kv_tiers=disk,redis", f"--kv_disk_dir={files / 'disk_evict'}",
              f"--kv_store_url={url}", "--kv_tier_write=evict", reqs="one")
  warn = [l for l in p.stderr.splitlines() if l.startswith("serve: warning:")]
  assert len(warn) == 1 and warn[0].startswith("serve: warning: KV tier redis unavailable (ConnectionError")
  assert warn[0].endswith("; continuing without it") and "Traceback" not in p.stderr
  assert outputs(files / "down")[0]["error"] is None
  s = summary(files / "down")
  assert "redis_failures" not in s                    # left out at start-up, never used
  assert s["disk_bytes_written"] == 0 and _records(files / "disk_evict") == 0


@pytest.mark.slow
def test_a_killed_process_leaves_what_it_stored_and_what_it_finished(files, cold):
  disk, out = files / "disk_killed", files / "killed"
  p = subprocess.Popen(_cmd(files, out, f"--requests={files / 'killed.jsonl'}", "--kv_tiers=disk",
                            f"--kv_disk_dir={disk}"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.monotonic() + 600
    done = []
    while time.monotonic() < deadline and p.poll() is None:
      if os.path.exists(out / "outputs.jsonl"):
        done = [json.loads(l) for l in open(out / "outputs.jsonl") if l.endswith("\n")]
      if len(done) >= 4 and _records(disk) >= 2:     # both sessions answered; the long third turn is decoding
        break
      time.sleep(0.2)
    assert p.poll() is None, "the process ended before it could be killed"
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=60) == -signal.SIGKILL
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  # outputs.jsonl of the killed run: the finished answers, each line whole, in finish order with id and line
  killed = [json.loads(l) for l in open(out / "outputs.jsonl")]
  assert {o["id"] for o in killed} == {"line1", "line2", "line3", "line4"}
  assert all(o["line"] == int(o["id"][4:]) and o["correct"] for o in killed)
  assert not os.path.exists(out / "metrics.json")
  serve(files, files / "rerun", "--kv_tiers=disk", f"--kv_disk_dir={disk}")
  s = summary(files / "rerun")
  assert s["tier_hit_tokens"] > 0 and s["disk_rejected"] == 0
  assert answers(files / "rerun") == answers(cold)


@pytest.fixture(scope="module")
def redis_url():
  require_server("redis")
  pytest.importorskip("redis", reason="the redis client library is not installed (pip install redis)")
  from cache.tiers.servers import RedisServer
  s = RedisServer()
  yield s.url
  s.stop()


@pytest.mark.slow
def test_a_second_process_reloads_from_redis(files, cold, redis_url):
  serve(files, files / "redis1", "--kv_tiers=redis", f"--kv_store_url={redis_url}")
  s1 = summary(files / "redis1")
  assert s1["redis_bytes_written"] > 0 and s1["tier_hit_tokens"] == 0
  p = serve(files, files / "redis2", "--kv_tiers=redis", f"--kv_store_url={redis_url}")
  s2 = summary(files / "redis2")
  assert s2["tier_hit_tokens"] > 0 and s2["redis_hit_tokens"] > 0 and s2["redis_failures"] == 0
  assert answers(files / "redis2") == answers(cold) and "warning" not in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True])
def test_a_store_lost_midway_is_one_warning_or_fatal_when_strict(files, redis_url, strict):
  from cache.tiers.servers import RedisServer
  server, out = RedisServer(), files / f"lost_{strict}"     # its own server: this test kills it
  try:
    p = subprocess.Popen(_cmd(files, out, f"--requests={files / 'killed.jsonl'}", "--kv_tiers=redis",
                              f"--kv_store_url={server.url}", *(["--kv_tiers_strict"] if strict else [])),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and p.poll() is None:
      if os.path.exists(out / "outputs.jsonl") and len(open(out / "outputs.jsonl").readlines()) >= 4:
        break                          # both sessions answered; the long third turn goes on writing blocks
      time.sleep(0.1)
    server.stop()
    _, err = p.communicate(timeout=600)
  finally:
    server.stop()
    if p.poll() is None:
      p.kill()
      p.wait()
  lines = [l for l in err.splitlines() if l.startswith("serve: ")]
  assert "Traceback" not in err and len(lines) == 1, err[-3000:]
  if strict:
    assert p.returncode == 2 and lines[0].startswith("serve: KV tier redis unavailable (")
    assert lines[0].endswith("and --kv_tiers_strict is set")
  else:
    assert p.returncode == 0 and lines[0].startswith("serve: warning: KV tier redis unavailable (")
    assert summary(out)["redis_failures"] >= 1 and all(o["error"] is None for o in outputs(out))
