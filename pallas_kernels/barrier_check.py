"""A static check of a Mosaic GPU (`plgpu.kernel`) kernel's barrier protocol, read from its traced jaxpr (no GPU).

Mosaic GPU's CPU interpreter (JAX 0.10.2) cannot run `sparse_attention_mgpu` (no `plgpu.load`, `run_state`,
transposed or register wgmma operands), so this is what checks its synchronisation on a CPU.

Model (mbarrier semantics, warpgroup level): a barrier completes a phase after `num_arrivals` arrivals; one
`plgpu.barrier_arrive` by a warpgroup is one arrival, and so is one `plgpu.copy_gmem_to_smem` naming the barrier
(its arrive-with-expected-bytes). A `barrier_wait` waits for the thread's next phase. The kernel body is walked once
per value of the thread axis (warpgroup); values known per warpgroup (the thread index and arithmetic on it, Python
constants) are tracked, branches on them are resolved, and other branch conditions become free variables.
Loops with a static trip count (`scan`) multiply the events inside; a `while` loop (dynamic trip count) is taken
as one phase per iteration, so events are grouped by how many `while` loops enclose them (their depth).

`check(...)` reports, per barrier (allocation, index):
  * arrivals per phase (all warpgroups, same depth) != num_arrivals, for any assignment of the free branch
    conditions (two warpgroups copying with a single-arrival barrier is the classic case: the second arrival falls
    into the next phase);
  * a wait at a depth where nobody arrives (it would hang, or run phases out of step), or more than one wait on the
    same barrier per phase by one warpgroup;
  * an index outside the allocation.
Indices that are not static per warpgroup (a ring slot computed from the loop counter) are reported as unchecked.
What is out of scope: the expected byte counts of copies, ordering between different barriers, data races.

`UnsupportedJaxpr` is raised when the jaxpr does not have the shape this reader knows (another JAX version).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

try:
  from jax._src import core as _jcore
  from jax._src.pallas.mosaic_gpu import core as _gpu_core
  from jax._src.state import types as _state_types
except ImportError:  # pragma: no cover - another JAX layout
  _jcore = _gpu_core = _state_types = None


class UnsupportedJaxpr(Exception):
  """The traced kernel does not have the structure this checker reads (e.g. another JAX version)."""


@dataclasses.dataclass(frozen=True)
class Barrier:
  alloc: int  # allocation number, in the order the kernel's run_scoped calls allocate them
  num_arrivals: int
  num_barriers: int


@dataclasses.dataclass(frozen=True)
class Event:
  kind: str  # "arrive" (barrier_arrive), "copy" (copy_gmem_to_smem: arrives) or "wait"
  alloc: int
  index: int | None  # None: not static per warpgroup
  thread: int  # the warpgroup (thread axis value) that executes it
  depth: int  # number of enclosing while loops (dynamic trip counts): one phase per innermost iteration
  mult: int  # times per iteration of the innermost while loop (static loops multiply)
  conds: tuple  # ((atom, value), ...): executed only when every free condition atom has that value
  where: str

  @property
  def arrives(self) -> bool:
    return self.kind in ("arrive", "copy")


@dataclasses.dataclass
class Report:
  barriers: list[Barrier]
  events: list[Event]
  num_threads: int
  problems: list[str]
  unchecked: list[str]

  def arrivals(self, alloc: int, index: int, depth: int = 0) -> dict[int, int]:
    """Unconditional arrivals per phase at `depth` by warpgroup (for assertions on a known protocol)."""
    out: dict[int, int] = {}
    for e in self.events:
      if e.arrives and (e.alloc, e.index, e.depth) == (alloc, index, depth) and not e.conds:
        out[e.thread] = out.get(e.thread, 0) + e.mult
    return out

  def waiters(self, alloc: int, index: int) -> set[int]:
    return {e.thread for e in self.events if e.kind == "wait" and (e.alloc, e.index) == (alloc, index)}


@dataclasses.dataclass(frozen=True)
class _Ref:
  alloc: int | None  # a barrier allocation, or None for any other ref


@dataclasses.dataclass(frozen=True)
class _Atom:
  id: int
  negated: bool = False


_BARRIER_PRIMS = {"barrier_arrive", "barrier_wait", "copy_gmem_to_smem"}
_ARITH = {"add", "sub", "mul", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "convert_element_type",
          "select_n", "max", "min", "rem", "div", "neg", "integer_pow"}


def _jaxpr_of(v):
  return v.jaxpr if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns") else v if hasattr(v, "eqns") else None


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for c in (v if isinstance(v, (tuple, list)) else [v]):
      j = _jaxpr_of(c)
      if j is not None:
        yield j


def _uses_barriers(jaxpr) -> bool:
  return any(e.primitive.name in _BARRIER_PRIMS or any(_uses_barriers(j) for j in _sub_jaxprs(e))
             for e in jaxpr.eqns)


def _where(eqn) -> str:
  try:
    from jax._src import source_info_util
    return source_info_util.summarize(eqn.source_info)
  except Exception:  # noqa: BLE001
    return eqn.primitive.name


def find_kernel(closed_jaxpr):
  """(kernel body jaxpr, number of threads, thread axis name) of the first Mosaic GPU kernel in a traced jaxpr."""
  def find(j):
    for e in j.eqns:
      if e.primitive.name == "mpmd_map" and e.params.get("jaxprs"):
        mesh = e.params["meshes"][0]
        return _jaxpr_of(e.params["jaxprs"][0]), mesh
      if e.primitive.name == "core_map" and "mesh" in e.params:
        return _jaxpr_of(e.params["jaxpr"]), e.params["mesh"]
      for sub in _sub_jaxprs(e):
        r = find(sub)
        if r is not None:
          return r
    return None
  r = find(closed_jaxpr.jaxpr)
  if r is None or r[0] is None:
    raise UnsupportedJaxpr("no mpmd_map / core_map Mosaic GPU kernel in the traced jaxpr")
  body, mesh = r
  n = getattr(mesh, "num_threads", None)
  name = getattr(mesh, "thread_name", None)
  if not n or not name:
    raise UnsupportedJaxpr(f"kernel mesh without a thread axis: {mesh}")
  return body, int(n), name


class _Walker:
  def __init__(self, thread: int, thread_name: str, barriers: list[Barrier], events: list[Event],
               unchecked: list[str], atoms: dict[int, int]):
    self.thread, self.thread_name = thread, thread_name
    self.barriers, self.events, self.unchecked, self.atoms = barriers, events, unchecked, atoms
    self.alloc_counter = itertools.count()

  # -- values
  def fresh_atom(self, domain=2):
    a = _Atom(len(self.atoms))  # ids unique across the walks of all warpgroups (one shared table)
    self.atoms[a.id] = domain
    return a

  def read(self, env, v):
    if isinstance(v, _jcore.Literal):
      return _scalar(v.val)
    return env.get(v)

  def barrier_index(self, env, leaves, what, eqn):
    alloc = self.read(env, leaves[0])
    if not isinstance(alloc, _Ref) or alloc.alloc is None:
      raise UnsupportedJaxpr(f"{what} on something that is not a scoped barrier allocation ({_where(eqn)})")
    rest = leaves[1:]
    if not rest:
      return alloc.alloc, 0
    if len(rest) != 1:
      raise UnsupportedJaxpr(f"{what}: barrier transforms other than one index ({_where(eqn)})")
    idx = self.read(env, rest[0])
    if not isinstance(idx, (int, np.integer)):
      self.unchecked.append(f"{what} at {_where(eqn)}: barrier index not static per warpgroup")
      return alloc.alloc, None
    return alloc.alloc, int(idx)

  def event(self, kind, alloc_idx, ctx, eqn):
    depth, mult, conds = ctx
    alloc, idx = alloc_idx
    self.events.append(Event(kind, alloc, idx, self.thread, depth, mult, tuple(sorted(conds)), _where(eqn)))

  # -- walking
  def walk(self, jaxpr, env, ctx):
    for eqn in jaxpr.eqns:
      self.eqn(eqn, env, ctx)
    return [self.read(env, v) for v in jaxpr.outvars]

  def bind_inner(self, inner, outer_vals, consts=None):
    env = {}
    for v, val in zip(inner.constvars, consts if consts is not None else [None] * len(inner.constvars)):
      env[v] = val
    for v, val in zip(inner.invars, outer_vals):
      env[v] = val
    return env

  def eqn(self, eqn, env, ctx):
    name = eqn.primitive.name
    ins = [self.read(env, v) for v in eqn.invars]
    outs = None
    if name == "barrier_arrive" or name == "barrier_wait":
      self.event("arrive" if name == "barrier_arrive" else "wait",
                 self.barrier_index(env, eqn.invars, name, eqn), ctx, eqn)
    elif name == "copy_gmem_to_smem":
      # operands: src, dst, [barrier] (JAX >= 0.11: only with has_barrier), src / dst / barrier transforms,
      # [predicate] (JAX >= 0.11)
      pr = eqn.params
      n_src, n_dst = pr["src_transforms_treedef"].num_leaves, pr["dst_transforms_treedef"].num_leaves
      if pr.get("has_barrier", True):
        n_bar = pr["barrier_transforms_treedef"].num_leaves
        start = 3 + n_src + n_dst
        bar = [eqn.invars[2]] + list(eqn.invars[start:start + n_bar])
        pred = [self.read(env, v) for v in eqn.invars[start + n_bar:]]
        if len(pred) > 1:
          raise UnsupportedJaxpr(f"copy_gmem_to_smem with {len(pred)} trailing operands ({_where(eqn)})")
        if pred and isinstance(pred[0], (bool, np.bool_, int, np.integer)) and not pred[0]:
          pass  # statically off: no copy, no arrival
        else:
          if pred and not isinstance(pred[0], (bool, np.bool_, int, np.integer)):  # a predicated copy: a free condition
            atom = pred[0] if isinstance(pred[0], _Atom) else self.fresh_atom()
            ctx = (ctx[0], ctx[1], ctx[2] | {(atom.id, 0 if atom.negated else 1)})
          self.event("copy", self.barrier_index(env, bar, name, eqn), ctx, eqn)
    elif name == "axis_index":
      outs = [self.thread if eqn.params.get("axis_name") == self.thread_name else None]
    elif name == "run_scoped":
      inner = _jaxpr_of(eqn.params["jaxpr"])
      allocs = []
      for v in inner.invars:
        aval = v.aval
        inner_aval = getattr(aval, "inner_aval", None)
        dt = getattr(inner_aval, "dtype", None)
        if isinstance(dt, _gpu_core.BarrierType):
          allocs.append(_Ref(self._alloc(dt, inner_aval.shape)))
        elif dt is not None and "barrier" in type(dt).__name__.lower():
          raise UnsupportedJaxpr(f"barrier kind {type(dt).__name__} is not modelled ({_where(eqn)})")
        else:
          allocs.append(_Ref(None))
      sub = self.bind_inner(inner, allocs, consts=ins)
      outs = self.walk(inner, sub, ctx)
    elif name == "cond":
      branches = eqn.params["branches"]
      idx = ins[0]
      ops = ins[1:]
      if isinstance(idx, (int, np.integer, bool, np.bool_)):
        b = branches[int(np.clip(int(idx), 0, len(branches) - 1))]
        outs = self.walk(b.jaxpr, self.bind_inner(b.jaxpr, ops, b.consts), ctx)
      else:
        atom = idx if isinstance(idx, _Atom) and len(branches) == 2 else self.fresh_atom(len(branches))
        for k, b in enumerate(branches):
          val = (1 - k) if atom.negated else k
          bctx = (ctx[0], ctx[1], ctx[2] | {(atom.id, val)})
          self.walk(b.jaxpr, self.bind_inner(b.jaxpr, ops, b.consts), bctx)
        outs = [None] * len(eqn.outvars)
    elif name == "while":
      body = eqn.params["body_jaxpr"]
      nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      vals = ins[nc:nc + nb] + [None] * (len(ins) - nc - nb)
      self.walk(body.jaxpr, self.bind_inner(body.jaxpr, vals, body.consts), (ctx[0] + 1, 1, ctx[2]))
      outs = [None] * len(eqn.outvars)
    elif name == "scan":
      body = eqn.params["jaxpr"]
      nc = eqn.params["num_consts"]
      vals = ins[:nc] + [None] * (len(ins) - nc)
      self.walk(body.jaxpr, self.bind_inner(body.jaxpr, vals, body.consts),
                (ctx[0], ctx[1] * int(eqn.params["length"]), ctx[2]))
      outs = [None] * len(eqn.outvars)
    elif name in ("jit", "pjit", "closed_call", "core_call", "run_state", "remat", "checkpoint", "custom_jvp_call",
                  "custom_vjp_call"):
      j = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
      inner = _jaxpr_of(j)
      if inner is None:
        raise UnsupportedJaxpr(f"{name} without a jaxpr ({_where(eqn)})")
      res = self.walk(inner, self.bind_inner(inner, ins, getattr(j, "consts", None)), ctx)
      outs = res if len(res) == len(eqn.outvars) else None
    elif any(True for _ in _sub_jaxprs(eqn)):
      if any(_uses_barriers(j) for j in _sub_jaxprs(eqn)):
        raise UnsupportedJaxpr(f"barrier operations inside {name}, which this checker does not model")
    elif name in _ARITH:
      outs = [self.arith(eqn, ins)]
    if outs is None:
      outs = [None] * len(eqn.outvars)
    for v, val in zip(eqn.outvars, outs):
      env[v] = val

  def _alloc(self, dt, shape):
    # Every warpgroup executes the same scoped allocations in the same order (collective run_scoped), so the
    # k-th barrier allocation of each walk is the same barrier.
    k = next(self.alloc_counter)
    b = Barrier(k, int(dt.num_arrivals), int(shape[0]) if shape else 1)
    if k == len(self.barriers):
      self.barriers.append(b)
    elif k > len(self.barriers) or self.barriers[k] != b:
      raise UnsupportedJaxpr("barrier allocations differ between warpgroups")
    return k

  def arith(self, eqn, ins):
    name = eqn.primitive.name
    if name == "not" and isinstance(ins[0], _Atom):
      return _Atom(ins[0].id, not ins[0].negated)
    if name == "convert_element_type" and isinstance(ins[0], _Atom):
      return ins[0]
    if any(x is None or isinstance(x, (_Atom, _Ref)) for x in ins) or any(v.aval.shape for v in eqn.outvars):
      if len(eqn.outvars) == 1 and eqn.outvars[0].aval.dtype == np.bool_ and not eqn.outvars[0].aval.shape:
        return self.fresh_atom()
      return None
    try:
      return _scalar(eqn.primitive.bind(*[np.asarray(x) for x in ins], **eqn.params))
    except Exception:  # noqa: BLE001
      return None


def _scalar(x):
  try:
    a = np.asarray(x)
  except Exception:  # noqa: BLE001
    return None
  if a.shape != ():
    return None
  if a.dtype == np.bool_:
    return bool(a)
  if np.issubdtype(a.dtype, np.integer):
    return int(a)
  return None


def collect(fn, *args, **kwargs) -> Report:
  """Trace fn(*args, **kwargs) (abstract args are fine), walk its Mosaic GPU kernel per warpgroup, check."""
  if _jcore is None:
    raise UnsupportedJaxpr("this JAX has no jax._src.pallas.mosaic_gpu")
  closed = jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
  body, n, thread_name = find_kernel(closed)
  barriers: list[Barrier] = []
  events: list[Event] = []
  unchecked: list[str] = []
  atoms: dict[int, int] = {}
  for t in range(n):
    w = _Walker(t, thread_name, barriers, events, unchecked, atoms)
    env = {v: _Ref(None) for v in body.invars}
    env.update({v: None for v in body.constvars})
    w.walk(body, env, (0, 1, frozenset()))
  return Report(barriers, events, n, _problems(barriers, events, atoms), sorted(set(unchecked)))


def _assignments(atom_ids, atoms):
  ids = sorted(atom_ids)
  if np.prod([atoms[a] for a in ids], dtype=np.float64) > 65536:
    raise UnsupportedJaxpr(f"too many free branch conditions ({len(ids)}) on one barrier")
  for vals in itertools.product(*[range(atoms[a]) for a in ids]):
    yield dict(zip(ids, vals))


def _holds(e: Event, asg) -> bool:
  return all(asg.get(a) == v for a, v in e.conds)


def _problems(barriers, events, atoms) -> list[str]:
  out = []
  by_key: dict[tuple, list[Event]] = {}
  for e in events:
    b = barriers[e.alloc]
    if e.index is not None and not 0 <= e.index < b.num_barriers:
      out.append(f"barrier {e.alloc}[{e.index}]: index outside its {b.num_barriers} barrier(s) ({e.where})")
      continue
    if e.index is not None:
      by_key.setdefault((e.alloc, e.index), []).append(e)
  for (alloc, idx), evs in sorted(by_key.items()):
    b = barriers[alloc]
    name = f"barrier {alloc}[{idx}] (num_arrivals={b.num_arrivals})"
    arr_depths = {e.depth for e in evs if e.arrives}
    if len(arr_depths) > 1:
      out.append(f"{name}: arrivals at different loop depths {sorted(arr_depths)}")
      continue
    for depth in arr_depths:
      arr = [e for e in evs if e.arrives and e.depth == depth]
      for asg in _assignments({a for e in arr for a, _ in e.conds}, atoms):
        n = sum(e.mult for e in arr if _holds(e, asg))
        if n != b.num_arrivals:
          who = sorted({(e.thread, e.kind, e.where) for e in arr if _holds(e, asg)})
          out.append(f"{name}: {n} arrival(s) per phase at loop depth {depth}"
                     f"{' when ' + str(asg) if asg else ''}: {who}")
          break
    for e in evs:
      if e.kind == "wait" and e.depth not in arr_depths:
        out.append(f"{name}: warpgroup {e.thread} waits at loop depth {e.depth} where nobody arrives "
                   f"(arrivals at {sorted(arr_depths) or 'none'}) ({e.where})")
    waits: dict[tuple, list[Event]] = {}
    for e in evs:
      if e.kind == "wait":
        waits.setdefault((e.thread, e.depth), []).append(e)
    for (t, d), ws in waits.items():
      for asg in _assignments({a for e in ws for a, _ in e.conds}, atoms):
        n = sum(e.mult for e in ws if _holds(e, asg))
        if n > 1:
          out.append(f"{name}: warpgroup {t} waits {n} times per phase at loop depth {d} "
                     f"({sorted({e.where for e in ws})})")
          break
  return out


def check(fn, *args, **kwargs) -> list[str]:
  """The problems `collect` finds (empty: the protocol is consistent under this model)."""
  return collect(fn, *args, **kwargs).problems
