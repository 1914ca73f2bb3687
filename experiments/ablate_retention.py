r"""Retention-interval ablation: SWA checkpoint blocks held by the cache vs tokens recomputed on resume.

    python -m experiments.ablate_retention                 # full -> out/ablate_retention/retention.{csv,json,png}
    python -m experiments.ablate_retention --small --out_dir=/tmp/x   # CI
    python -m experiments.ablate_retention --refresh_results   # refresh the committed experiments/results/retention.*
    python -m experiments.ablate_retention --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/ablate_retention/, untracked); --refresh_results writes the committed
experiments/results/ instead. --replot re-draws retention.png from the retention.json already there, without the
sweep. Other flags: --intervals, --config, --seed, --small, --verify_engine.

Cache-only: hits depend only on the tokens and the block bookkeeping, never on the model's numbers, so the sweep
drives `cache.manager.KVCacheManager` directly (exactly as the engine does: add_request, chunked allocate/commit,
answer tokens appended and committed with the last sampled token not fed back, free) with fixed synthetic answers
(seeded random tokens). Geometry of `--config` (default v4_flash: 128-token full blocks / resume alignment, 32-token
swa blocks, 127-row tail = 4 swa blocks per checkpoint). The pools are large enough that nothing is evicted, so
"held" is what the retention policy keeps, not what pressure leaves.

Workloads (multi-turn sessions that resume at points that are not prompt/turn boundaries of earlier requests):
  doc_branch  a reader request reads a long shared document; then sessions branch from the document at random
              cut points (prompt = doc[:cut] + question) and continue for more turns.
  chat_fork   multi-turn chat sessions; then forked sessions re-use an earlier session's history up to a random
              token (an edited / regenerated message) and continue for more turns.
  edit_last   chat sessions whose last user message is then edited (resume inside that message).
  alternate   pairs of sessions served A B A B (every resume at the session's own previous request end).
  agent_loop  agents appending tool outputs, short unrelated requests in between, retries from inside the last
              tool output.
--workloads picks the traces (default doc_branch,chat_fork: the committed retention.*; the last three write
retention_multiturn.* with --stem=retention_multiturn), --swa_pool_blocks bounds the swa pool (0: never evicts).
Metrics per retention interval R: swa blocks cached (resident checkpoint blocks) at the end and their bytes for the
config, full blocks cached, prompt tokens, hit tokens, recomputed tokens (prompt tokens not covered by a hit), and
the same restricted to the branch / fork requests (the resumes R is for).

`--verify_engine` (default on in the full run) replays a small doc_branch trace through the real Engine (v4_tiny
or the trained model) at R = 0 and 128, then replays the same trace (with the engine's own answers) through the
manager, and checks every request's hit matches.

Plot: (1) the trade-off, tokens recomputed on branch/fork resumes against swa checkpoint blocks held, one line per
workload and one marker shape per R (legend); (2) tokens recomputed and (3) swa blocks held against R on a log2 axis
(symlog: R = 0 sits one step left of the smallest R).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np
from absl import app, flags, logging

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import PRESETS, v4_tiny
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.request import RequestOutput
from dsv4.engine.sampling import SamplingParams
from dsv4.model import init_params
from experiments import plotting, train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_retention"


def define_flags():
  """The command line (defined when run as a script: ablate_eviction, the tests and the notebook import the traces
  and drivers here, and must not get this script's flags)."""
  flags.DEFINE_bool("small", False, "CI: a few sessions, a few sweep points.")
  flags.DEFINE_string("config", "v4_flash", "Model config preset whose cache geometry is used.")
  flags.DEFINE_integer("seed", 0, "Workload seed.")
  flags.DEFINE_list("intervals", ["0", "128", "256", "512", "1024", "2048"], "Retention intervals (multiples of 128).")
  flags.DEFINE_list("workloads", ["doc_branch", "chat_fork"], "Traces to sweep: doc_branch, chat_fork (the "
                    "committed retention.*), edit_last, alternate, agent_loop (retention_multiturn.*).")
  flags.DEFINE_string("stem", "retention", "Output file stem.")
  flags.DEFINE_integer("swa_pool_blocks", 0, "0: pools never evict; n > 0: the swa pool holds n blocks (the "
                       "checkpoints R adds then compete for it).")
  flags.DEFINE_bool("verify_engine", None, "Check a small trace through the real Engine (default: on unless --small).")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no sweep).")
  plotting.define_output_flags(SCRIPT, "retention.csv/json/png")


# ------------------------------------------------------------------------------------------ traces
@dataclasses.dataclass(frozen=True)
class Spec:
  """One request of a sequential trace. Its prompt is `src` session's history (all of it, or its first `cut`
  tokens) followed by `new`; afterwards `session`'s history is prompt + answer."""
  rid: str
  session: str
  new: tuple[int, ...]
  n_out: int
  src: str | None = None
  cut: int | None = None
  tenant: str = ""
  kind: str = "turn"             # turn | branch (resume from a non-boundary point) | first


def synthetic_answer(vocab: int, seed: int = 0) -> Callable[[Spec, list[int]], list[int]]:
  def answer(spec: Spec, prompt: list[int]) -> list[int]:
    rng = np.random.default_rng([seed, abs(hash(spec.rid)) % (1 << 31)])
    return [int(t) for t in rng.integers(2, vocab, spec.n_out)]
  return answer


def prompts_of(trace, answer):
  """Yields (spec, prompt, answer) in order, building histories."""
  hist: dict[str, list[int]] = {}
  for s in trace:
    base = hist.get(s.src or s.session, [])
    if s.cut is not None:
      base = base[:s.cut]
    prompt = base + list(s.new)
    out = yield s, prompt
    hist[s.session] = prompt + list(out)


def _toks(rng, n, vocab):
  return tuple(int(t) for t in rng.integers(2, vocab, int(n)))


def doc_branch(vocab, *, docs=2, doc_len=4096, branches=6, turns=3, q_len=(32, 96), a_len=(32, 128), seed=0):
  rng = np.random.default_rng([seed, 1])
  out = []
  for d in range(docs):
    doc = _toks(rng, doc_len, vocab)
    out.append(Spec(f"doc{d}.read", f"doc{d}", doc + _toks(rng, rng.integers(*q_len), vocab),
                    int(rng.integers(*a_len)), kind="first"))
    for b in range(branches):
      cut = int(rng.integers(doc_len // 8, doc_len))
      s = f"doc{d}.b{b}"
      out.append(Spec(f"{s}.t0", s, _toks(rng, rng.integers(*q_len), vocab), int(rng.integers(*a_len)),
                      src=f"doc{d}", cut=cut, kind="branch"))
      for t in range(1, turns):
        out.append(Spec(f"{s}.t{t}", s, _toks(rng, rng.integers(*q_len), vocab), int(rng.integers(*a_len))))
  return out


def chat_fork(vocab, *, sessions=4, turns=5, forks=8, fork_turns=2, system_len=512, u_len=(64, 384),
              a_len=(32, 256), seed=0):
  rng = np.random.default_rng([seed, 2])
  system = _toks(rng, system_len, vocab)
  out, lens = [], {}
  for s in range(sessions):
    n = 0
    for t in range(turns):
      new = (system if t == 0 else ()) + _toks(rng, rng.integers(*u_len), vocab)
      a = int(rng.integers(*a_len))
      out.append(Spec(f"chat{s}.t{t}", f"chat{s}", new, a, kind="first" if t == 0 else "turn"))
      n += len(new) + a
    lens[f"chat{s}"] = n
  for f in range(forks):
    src = f"chat{int(rng.integers(sessions))}"
    cut = int(rng.integers(system_len, lens[src]))
    s = f"fork{f}"
    out.append(Spec(f"{s}.t0", s, _toks(rng, rng.integers(*u_len), vocab), int(rng.integers(*a_len)), src=src,
                    cut=cut, kind="branch"))
    for t in range(1, fork_turns):
      out.append(Spec(f"{s}.t{t}", s, _toks(rng, rng.integers(*u_len), vocab), int(rng.integers(*a_len))))
  return out


def edit_last(vocab, *, sessions=4, turns=4, edits=2, system_len=512, u_len=(64, 384), a_len=(32, 256), seed=0):
  """Chat sessions; after them each session's last user message is edited `edits` times: the prompt keeps the
  history up to a random point inside that message (the user rewrote its tail) and appends a new tail."""
  rng = np.random.default_rng([seed, 3])
  system = _toks(rng, system_len, vocab)
  out = []
  for s in range(sessions):
    n = 0
    for t in range(turns):
      new = (system if t == 0 else ()) + _toks(rng, rng.integers(*u_len), vocab)
      a = int(rng.integers(*a_len))
      out.append(Spec(f"chat{s}.t{t}", f"chat{s}", new, a, kind="first" if t == 0 else "turn"))
      last_start, last_len = n + (len(system) if t == 0 else 0), len(new) - (len(system) if t == 0 else 0)
      n += len(new) + a
    for e in range(edits):
      cut = last_start + int(rng.integers(0, last_len))
      out.append(Spec(f"chat{s}.edit{e}", f"chat{s}.e{e}", _toks(rng, rng.integers(16, 128), vocab),
                      int(rng.integers(*a_len)), src=f"chat{s}", cut=cut, kind="branch"))
  return out


def alternate(vocab, *, pairs=3, turns=6, system_len=1024, u_len=(32, 256), a_len=(32, 256), seed=0):
  """Sessions served in alternation (A B A B ..., `pairs` pairs of sessions, each pair its own system prompt):
  every turn resumes at the end of its own session's previous request, after the other session ran."""
  rng = np.random.default_rng([seed, 4])
  out = []
  for p in range(pairs):
    system = _toks(rng, system_len, vocab)
    for t in range(turns):
      for x in "ab":
        new = (system if t == 0 else ()) + _toks(rng, rng.integers(*u_len), vocab)
        out.append(Spec(f"p{p}{x}.t{t}", f"p{p}{x}", new, int(rng.integers(*a_len)),
                        kind="first" if t == 0 else "turn"))
  return out


def agent_loop(vocab, *, agents=3, steps=8, task_len=1024, tool_len=(128, 1024), a_len=(16, 96), short=2,
               short_len=(32, 256), retry_p=0.3, seed=0):
  """Agent sessions (long task, tool outputs appended step by step, short actions), with `short` unrelated short
  requests between consecutive agent steps, and retries: with probability retry_p a step is redone from a random
  point inside the previous tool output (the tool result was cut or replaced), a resume inside history."""
  rng = np.random.default_rng([seed, 5])
  out, lens = [], {}
  q = 0
  for st in range(steps):
    for g in range(agents):
      s = f"agent{g}"
      if st == 0:
        new = _toks(rng, task_len, vocab)
        out.append(Spec(f"{s}.s0", s, new, int(rng.integers(*a_len)), kind="first"))
        lens[s] = (len(new) + out[-1].n_out, 0, len(new))
      else:
        n, prev_n, prev_len = lens[s]
        new = _toks(rng, rng.integers(*tool_len), vocab)
        a = int(rng.integers(*a_len))
        if rng.random() < retry_p and st > 1:
          cut = prev_n + int(rng.integers(0, prev_len))
          out.append(Spec(f"{s}.s{st}.retry", s, new, a, src=s, cut=cut, kind="branch"))
          lens[s] = (cut + len(new) + a, cut, len(new))
        else:
          out.append(Spec(f"{s}.s{st}", s, new, a))
          lens[s] = (n + len(new) + a, n, len(new))
      for _ in range(short):
        out.append(Spec(f"short{q}", f"short{q}", _toks(rng, rng.integers(*short_len), vocab),
                        int(rng.integers(8, 32)), kind="first"))
        q += 1
  return out


TRACES = {"doc_branch": doc_branch, "chat_fork": chat_fork, "edit_last": edit_last, "alternate": alternate,
          "agent_loop": agent_loop}
SMALL_TRACE_ARGS = {"doc_branch": dict(docs=1, doc_len=1024, branches=3, turns=2),
                    "chat_fork": dict(sessions=2, turns=3, forks=3, fork_turns=2, system_len=256, u_len=(64, 192),
                                      a_len=(32, 96)),
                    "edit_last": dict(sessions=2, turns=2, edits=2, system_len=256),
                    "alternate": dict(pairs=1, turns=3, system_len=256),
                    "agent_loop": dict(agents=2, steps=3, task_len=256, tool_len=(64, 256), short=1)}


# ------------------------------------------------------------------------------------------ drivers
def serve_one(m, spec: Spec, prompt: list[int], answer: list[int], chunk: int = 512) -> int:
  """Drives the manager through one request the way the engine does; returns the admission hit."""
  L = len(prompt)
  hit = m.add_request(spec.rid, prompt, ExtraKeys(tenant=spec.tenant))
  n = hit.num_tokens
  while n < L:
    c = min(chunk, L - n)
    if not m.allocate_for(spec.rid, c):
      raise RuntimeError(f"{spec.rid}: pool too small ({m.allocate_for(spec.rid, c)})")
    n += c
    m.commit(spec.rid, n)
  m.append_tokens(spec.rid, answer)
  if len(answer) > 1:                     # the last sampled token is never fed back
    if not m.allocate_for(spec.rid, len(answer) - 1):
      raise RuntimeError(f"{spec.rid}: pool too small for its answer")
    m.commit(spec.rid, L + len(answer) - 1)
  m.free(spec.rid)
  return hit.num_tokens


def run_trace(m, trace, answer, on_request=None) -> list[dict]:
  """Sequentially serves a trace through a manager; one row per request."""
  rows = []
  gen = prompts_of(trace, answer)
  spec, prompt = next(gen)
  while True:
    ans = answer(spec, prompt)
    hit = serve_one(m, spec, prompt, ans)
    rows.append(dict(rid=spec.rid, kind=spec.kind, prompt=len(prompt), hit=hit))
    if on_request:
      on_request(m, rows[-1])
    try:
      spec, prompt = gen.send(ans)
    except StopIteration:
      return rows


def cached_blocks(m, group: str) -> int:
  return int(np.asarray(m.pools[group].cached_N).sum())


def summarize(rows, m) -> dict:
  br = [r for r in rows if r["kind"] == "branch"]
  prompt = sum(r["prompt"] for r in rows)
  hit = sum(r["hit"] for r in rows)
  return dict(requests=len(rows), prompt_tokens=prompt, hit_tokens=hit, recomputed_tokens=prompt - hit,
              hit_pct=100.0 * hit / max(prompt, 1),
              branch_requests=len(br), branch_prompt_tokens=sum(r["prompt"] for r in br),
              branch_recomputed_tokens=sum(r["prompt"] - r["hit"] for r in br),
              swa_blocks_cached=cached_blocks(m, "swa"), full_blocks_cached=cached_blocks(m, "full"),
              swa_mb_cached=cached_blocks(m, "swa") * m.specs.swa.bytes_per_block / 2**20,
              full_mb_cached=cached_blocks(m, "full") * m.specs.group("full").bytes_per_block / 2**20)


def trace_sizes(trace, answer):
  """Total tokens a trace computes at most (to size pools that never evict)."""
  total, gen = 0, prompts_of(trace, answer)
  spec, prompt = next(gen)
  while True:
    ans = answer(spec, prompt)
    total += len(prompt) + len(ans)
    try:
      spec, prompt = gen.send(ans)
    except StopIteration:
      return total


def workloads(vocab: int, small: bool, seed: int, names=("doc_branch", "chat_fork")) -> dict:
  if tuple(names) != ("doc_branch", "chat_fork"):
    return {n: TRACES[n](vocab, seed=seed, **(SMALL_TRACE_ARGS[n] if small else {})) for n in names}
  if small:
    return {"doc_branch": doc_branch(vocab, docs=1, doc_len=1024, branches=3, turns=2, seed=seed),
            "chat_fork": chat_fork(vocab, sessions=2, turns=3, forks=3, fork_turns=2, system_len=256,
                                   u_len=(64, 192), a_len=(32, 96), seed=seed)}
  return {"doc_branch": doc_branch(vocab, seed=seed), "chat_fork": chat_fork(vocab, seed=seed)}


# ------------------------------------------------------------------------------------------ engine check
def load_model(note=print):
  """(config, params, source): the trained model when shipped, else random tiny V4 weights."""
  try:
    config, params = train_lib.load_trained("v4_retrieval")
    return config, params, "trained v4_retrieval"
  except (ImportError, FileNotFoundError, OSError, AttributeError) as e:
    note(f"note: trained model unavailable ({type(e).__name__}: {e}); using random v4_tiny weights")
    config = v4_tiny()
    return config, init_params(config, jax.random.PRNGKey(0)), "random v4_tiny"


def verify_engine(intervals=(0, 128), seed: int = 0) -> list[dict]:
  """Runs a small doc_branch trace through the real Engine; the manager replay (same answers) must agree."""
  config, params, source = load_model(logging.info)
  V = config.vocab_size
  trace = doc_branch(V, docs=1, doc_len=640, branches=3, turns=2, q_len=(16, 40), a_len=(8, 16), seed=seed)
  out = []
  for R in intervals:
    ec = EngineConfig(max_num_seqs=1, chunk_size=64, max_model_len=1024, num_full_blocks=64, num_swa_blocks=128,
                      retention_interval=R)
    eng = Engine(params, config, ec)
    answers = {}
    t0 = time.time()

    def engine_answer(spec, prompt):
      eng.add_request(spec.rid, prompt, SamplingParams(max_tokens=spec.n_out, ignore_eos=True))
      eng.run()
      answers[spec.rid] = list(eng.requests[spec.rid].all_tokens[len(prompt):])
      return answers[spec.rid]

    gen = prompts_of(trace, None)
    spec, prompt = next(gen)
    while True:
      ans = engine_answer(spec, prompt)
      try:
        spec, prompt = gen.send(ans)
      except StopIteration:
        break
    wall = time.time() - t0
    eng_hits = {rid: RequestOutput.of(eng.requests[rid]).hit_tokens for rid in answers}
    m = KVCacheManager(group_specs(config), num_full_blocks=64, num_swa_blocks=128, retention_interval=R,
                       model_id=ec.model_id)
    rows = run_trace(m, trace, lambda spec, prompt: answers[spec.rid])
    sim = {r["rid"]: r["hit"] for r in rows}
    agree = all(sim[k] == eng_hits[k] for k in sim)
    out.append(dict(retention_interval=R, model=source, engine_hit_tokens=sum(eng_hits.values()),
                    manager_hit_tokens=sum(sim.values()), per_request_agree=agree, engine_wall_s=round(wall, 1)))
    logging.info("engine check R=%d: %s", R, out[-1])
    if not agree:
      logging.warning("engine vs manager hits differ: %s", {k: (eng_hits[k], sim[k]) for k in sim})
  return out


# ------------------------------------------------------------------------------------------ main
def run(config_name: str, intervals, small: bool, out_dir: str, seed: int = 0, check_engine: bool = False,
        stem: str = "retention", names=("doc_branch", "chat_fork"), swa_pool_blocks: int = 0) -> dict:
  config = PRESETS[config_name]()
  answer = synthetic_answer(config.vocab_size, seed)
  wl = workloads(config.vocab_size, small, seed, names)
  rows = []
  for name, trace in wl.items():
    need = trace_sizes(trace, answer)
    nf, ns = need // 128 + 64, need // 32 + 64            # never evicts: held = what the policy keeps
    if swa_pool_blocks:
      ns = swa_pool_blocks
    for R in intervals:
      t0 = time.time()
      m = KVCacheManager(group_specs(config), num_full_blocks=nf, num_swa_blocks=ns, retention_interval=R,
                         enable_events=False)
      res = run_trace(m, trace, answer)
      rows.append(dict(workload=name, retention_interval=R, **summarize(res, m), wall_s=round(time.time() - t0, 2)))
      logging.info("%s R=%d: %s", name, R, rows[-1])
  engine_rows = verify_engine(seed=seed) if check_engine else []
  meta = dict(config=config_name, small=small, seed=seed, swa_pool_blocks=swa_pool_blocks,
              pools=(f"swa pool of {swa_pool_blocks} blocks" if swa_pool_blocks else "sized so nothing is evicted"),
              engine_check=engine_rows,
              note="cache-only: KVCacheManager driven directly with synthetic answers (hits do not depend on "
                   "model outputs); recomputed = prompt tokens not covered by the admission hit")
  sp = group_specs(config)
  meta["swa_bytes_per_block"] = sp.swa.bytes_per_block
  meta["full_bytes_per_block"] = sp.group("full").bytes_per_block
  csv_path, json_path = plotting.write_table(rows, out_dir, stem, meta)

  png = plotting.save_figure((plot if stem == "retention" else plot_hits)(rows, meta), out_dir, stem)
  print(f"wrote {csv_path} {json_path} {png}")
  return dict(rows=rows, engine=engine_rows, csv=csv_path, json=json_path, png=png)


def plot(rows: list[dict], meta: dict):
  """Trade-off (recomputed on resumes vs swa blocks held; marker = R) and both against R (symlog, log2)."""
  names = list(dict.fromkeys(x["workload"] for x in rows))
  intervals = sorted({x["retention_interval"] for x in rows})
  fig, (trade, rec, held) = plotting.new_figure(3, width=4.8)
  n = len(names)
  r_marker = {R: plotting.series_style(j, len(intervals))["marker"] for j, R in enumerate(intervals)}
  r_size = {R: 5.0 + 2.0 * (len(intervals) - 1 - j) for j, R in enumerate(intervals)}
  handles = []
  for i, name in enumerate(names):
    r = sorted((x for x in rows if x["workload"] == name), key=lambda x: x["retention_interval"])
    R = [x["retention_interval"] for x in r]
    st = plotting.series_style(i, n)
    # trade-off: the workload's curve (in order of blocks held), then one hollow marker per R in the workload's
    # colour; the marker shape says which R (legend), so no text sits at the points, and the marker shrinks as R
    # grows, so R values that land on the same point nest (R = 0 and R = 512 in the --small run)
    tr = sorted(r, key=lambda x: (x["swa_blocks_cached"], -x["branch_recomputed_tokens"]))
    trade.plot([x["swa_blocks_cached"] for x in tr], [x["branch_recomputed_tokens"] for x in tr],
               **dict(st, marker="None"), label=name)
    for x in r:
      trade.plot([x["swa_blocks_cached"]], [x["branch_recomputed_tokens"]], linestyle="None",
                 marker=r_marker[x["retention_interval"]], markersize=r_size[x["retention_interval"]],
                 markerfacecolor="none", markeredgecolor=st["color"], markeredgewidth=1.3, zorder=st["zorder"] + 10,
                 label="_nolegend_")
    handles.append(plotting.proxy(name, color=st["color"], linestyle=st["linestyle"], linewidth=st["linewidth"]))
    rec.plot(R, [x["recomputed_tokens"] for x in r], label=f"{name}: all requests", **plotting.series_style(i, n, "-"))
    rec.plot(R, [x["branch_recomputed_tokens"] for x in r], label=f"{name}: branch / fork requests",
             **plotting.series_style(i, n, "--", hollow=True))
    held.plot(R, [x["swa_blocks_cached"] for x in r], label=name, **st)
  handles += [plotting.proxy(f"R = {R}", color="0.3", linestyle="None", marker=r_marker[R], markerfacecolor="none",
                             markersize=min(r_size[R], 9.0)) for R in intervals]
  config = meta.get("config", "")
  trade.set(xlabel="swa checkpoint blocks cached", ylabel="tokens recomputed on branch / fork resumes",
            title=f"{config}: retention trade-off")
  plotting.legend_below(trade, *zip(*handles), ncol=2)
  r_label = "retention interval R (0 = prompt / turn boundaries only)"
  for ax in (rec, held):
    plotting.knob_axis(ax, intervals, r_label)
  rec.set(ylabel="prompt tokens recomputed", title="recompute vs retention interval")
  held.set(ylabel="swa checkpoint blocks cached", title="checkpoint blocks held vs retention interval")
  plotting.legend_below(rec, ncol=1)
  plotting.legend_below(held, ncol=1)
  return fig


def plot_hits(rows: list[dict], meta: dict):
  """Multi-turn traces: (1) hit tokens against checkpoint bytes held (one line per workload, points in order of R,
  marker = R); (2) hit % and (3) swa checkpoint MB against R (symlog / log2)."""
  names = list(dict.fromkeys(x["workload"] for x in rows))
  intervals = sorted({x["retention_interval"] for x in rows})
  fig, (trade, hit, held) = plotting.new_figure(3, width=4.8)
  n = len(names)
  r_marker = {R: plotting.series_style(j, len(intervals))["marker"] for j, R in enumerate(intervals)}
  handles = []
  for i, name in enumerate(names):
    r = sorted((x for x in rows if x["workload"] == name), key=lambda x: x["retention_interval"])
    R = [x["retention_interval"] for x in r]
    st = plotting.series_style(i, n)
    trade.plot([x["swa_mb_cached"] for x in r], [x["hit_pct"] for x in r], **dict(st, marker="None"))
    for x in r:
      trade.plot([x["swa_mb_cached"]], [x["hit_pct"]], linestyle="None", marker=r_marker[x["retention_interval"]],
                 markersize=7, markerfacecolor="none", markeredgecolor=st["color"], markeredgewidth=1.3,
                 zorder=st["zorder"] + 10, label="_nolegend_")
    handles.append(plotting.proxy(name, color=st["color"], linestyle=st["linestyle"], linewidth=st["linewidth"]))
    hit.plot(R, [x["hit_pct"] for x in r], label=name, **st)
    held.plot(R, [x["swa_mb_cached"] for x in r], label=name, **st)
  handles += [plotting.proxy(f"R = {R}", color="0.3", linestyle="None", marker=r_marker[R], markerfacecolor="none",
                             markersize=7) for R in intervals]
  pools = "pools never evict" if not meta.get("swa_pool_blocks") else f"swa pool {meta['swa_pool_blocks']} blocks"
  trade.set(xlabel="swa checkpoint MB held (end of trace)", ylabel="prefix hit (% of prompt tokens)",
            title=f"{meta.get('config', '')}: hits vs checkpoint bytes ({pools})")
  plotting.legend_below(trade, *zip(*handles), ncol=2)
  for ax in (hit, held):
    plotting.knob_axis(ax, intervals, "retention interval R (tokens; 0 = boundaries only)")
  hit.set(ylabel="prefix hit (% of prompt tokens)", title="hit vs retention interval")
  held.set(ylabel="swa checkpoint MB held", title="checkpoint bytes vs retention interval")
  plotting.legend_below(hit, ncol=1)
  plotting.legend_below(held, ncol=1)
  return fig


def main(argv):
  del argv
  intervals = [int(x) for x in FLAGS.intervals]
  if FLAGS.small and FLAGS["intervals"].using_default_value:
    intervals = [0, 128, 512]
  check = (not FLAGS.small) if FLAGS.verify_engine is None else FLAGS.verify_engine
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    stem = FLAGS.stem
    print("wrote", plotting.save_figure((plot if stem == "retention" else plot_hits)(
        *plotting.read_table(out_dir, stem)), out_dir, stem))
    return
  run(FLAGS.config, intervals, FLAGS.small, out_dir, FLAGS.seed, check, stem=FLAGS.stem, names=FLAGS.workloads,
      swa_pool_blocks=FLAGS.swa_pool_blocks)


if __name__ == "__main__":
  define_flags()
  app.run(main)
