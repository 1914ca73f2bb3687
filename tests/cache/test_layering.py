"""Import graph: cache/ imports nothing from dsv4/ (or experiments/, benchmarks/), and the package graph is
acyclic: experiments -> dsv4.serving (replicas, router) -> dsv4.engine -> (cache, dsv4 model) -> pallas_kernels."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("cache", "dsv4", "pallas_kernels", "experiments", "benchmarks")


def _imports(path: pathlib.Path) -> set[str]:
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
  return out


def _package_of(mod: str) -> str | None:
  top = mod.split(".")[0]
  for layer in ("dsv4.serving", "dsv4.engine"):
    if top == "dsv4" and mod.startswith(layer):
      return layer
  return top if top in PACKAGES else None


def _graph():
  g = {}
  for pkg in PACKAGES:
    for f in (ROOT / pkg).rglob("*.py"):
      rel = f.relative_to(ROOT).with_suffix("")
      src = ".".join(rel.parts)
      sp = _package_of(src)
      for m in _imports(f):
        dp = _package_of(m)
        if dp and dp != sp:
          g.setdefault(sp, set()).add(dp)
  return g


def test_cache_imports_no_model():
  bad = []
  for f in (ROOT / "cache").rglob("*.py"):
    bad += [(str(f.relative_to(ROOT)), m) for m in _imports(f) if _package_of(m) not in (None, "cache")]
  assert not bad, f"cache/ must import only itself (and third-party packages): {bad}"


def test_package_graph_acyclic():
  g = _graph()
  state = {}

  def visit(n, path):
    if state.get(n) == 1:
      raise AssertionError(f"import cycle: {' -> '.join(path + [n])}")
    if state.get(n) == 2:
      return
    state[n] = 1
    for m in sorted(g.get(n, ())):
      visit(m, path + [n])
    state[n] = 2

  for n in sorted(g):
    visit(n, [])
  assert "dsv4" not in g.get("cache", set()) and "dsv4.engine" not in g.get("dsv4", set())
