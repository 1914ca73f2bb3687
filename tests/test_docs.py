"""The prose documentation names only things that exist.

Scanned: `README.md`, `BUILD_NOTES.md`, `docs/*.md`, `experiments/CACHE_ABLATIONS.md`, `experiments/TRAIN_NOTES.md`.
Nothing is imported: the checks read files and parse Python source.

* **Repository paths.** A path is a run of `[A-Za-z0-9_./*-]` that starts with one of the repository's top-level
  directories and a slash (`cache/`, `dsv4/`, `pallas_kernels/`, `experiments/`, `benchmarks/`, `tests/`, `docs/`,
  `.ci/`) and is not glued to a preceding word, dot, slash, dash or quote: in prose, inline code, code blocks and
  link targets alike, so `--out_dir=experiments/checkpoints/x` names `experiments/checkpoints/x`, while
  `out/serve/outputs.jsonl` or `/tmp/kv` are not paths and a quoted string such as `"dsv4/kv/1"` is a literal.
  It must exist. `*` is a glob that must match something; `{a,b}` expands to both. Output that commands write
  (`out/`, `ckpt/`, `/tmp/`, `.oracle/`, `<out_dir>/`) never starts with a top-level
  directory, so it is never checked (`GENERATED` lists those roots).
* **Test ids.** `path::name` (with an optional `[params]`) also needs `def name` or `class name` in that file.
* **Bare test files.** Inline code holding only `test_x.py` (the lists in `docs/references.md`) must name a file
  in the directory of the last path under `tests/` named before it on the page (`tests/` if none).
* **Modules.** `python -m a.b` for a repository package (anywhere in the text, across a line break too) must resolve
  to `a/b.py` or `a/b/__init__.py`. Inline code holding only a dotted name that starts with a repository package
  (`cache.tiers.cost.CostModel.load_seconds`, optionally followed by `(...)`) must resolve to a module plus at
  most two attribute levels: the first defined, assigned or imported at the module's top level (or a submodule of
  a package), the second, when the first is a class, defined in its body. Deeper names are not checked.
* **Class members.** Inline code holding only `Class.member` (optionally followed by `(...)`), where `Class` is a
  top-level class of a package module (tests left out), must name something its body defines or assigns, or its
  methods assign on `self`, in that class or a base class of the packages.
* **Relative links** (`[x](model.md)`) must name a file relative to the page.
"""

import ast
import functools
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOP_DIRS = ("cache", "dsv4", "pallas_kernels", "experiments", "benchmarks", "tests", "docs", ".ci")
PACKAGES = ("cache", "dsv4", "pallas_kernels", "experiments", "benchmarks", "tests")

# Where commands write their output. None of these starts with a top-level directory, so the path pattern never
# matches them; an output directory under one (none today) would be added here and skipped.
GENERATED = ("out/", "ckpt/", "/tmp/", ".oracle/")

_TOP = "|".join(re.escape(d) for d in TOP_DIRS)
_PATH_IN_TEXT = re.compile(
    r"(?<![\w./'\"-])(?:\./)?((?:%s)/[\w./*-]*(?:\{[\w.,-]*\}[\w./*-]*)?(?:::\w+)*(?:\[[^\]\s]*\])?)" % _TOP)
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PYTHON_M = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
_DOTTED = re.compile(r"^(?:%s)(?:\.[A-Za-z_]\w*)+(?:\(.*\))?$" % "|".join(PACKAGES))


def _docs():
  names = ["README.md", "BUILD_NOTES.md", "experiments/CACHE_ABLATIONS.md", "experiments/TRAIN_NOTES.md"]
  names += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
  return [n for n in names if os.path.exists(os.path.join(ROOT, n))]


def _line_of(text, pos):
  return text.count("\n", 0, pos) + 1


def _code_pieces(text):
  """(line, text) of every fenced block and inline code span; inline spans are looked for outside fences."""
  pieces = []
  blanked = text
  for m in _FENCE.finditer(text):
    pieces.append((_line_of(text, m.start(1)), m.group(1)))
    blanked = blanked[:m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + blanked[m.end():]
  for m in _INLINE.finditer(blanked):
    pieces.append((_line_of(text, m.start(1)), m.group(1)))
  return pieces, blanked


def _expand(token):
  m = re.search(r"\{([^{}]*)\}", token)
  if not m:
    return [token]
  return [token[:m.start()] + alt + token[m.end():] for alt in m.group(1).split(",")]


def _strip(token):
  token = token.rstrip(".:;,'\"`)")
  if token.endswith("]") and "[" not in token:
    token = token[:-1]
  if token.startswith("./"):
    token = token[2:]
  return token


@functools.lru_cache(maxsize=None)
def _test_names(path):
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    src = f.read()
  return set(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", src, re.M))


def _check_path(token):
  """None if fine, else why not."""
  path, _, test = token.partition("::")
  path = path.rstrip("/")
  if any(path.startswith(g) for g in GENERATED):
    return None
  if "*" in path:
    return None if glob.glob(os.path.join(ROOT, path)) else "no file matches"
  if not os.path.exists(os.path.join(ROOT, path)):
    return "missing"
  if test:
    name = test.split("[", 1)[0].split("::")[-1]
    if not os.path.isfile(os.path.join(ROOT, path)) or name not in _test_names(path):
      return f"no def {name} in {path}"
  return None


def _module_file(dotted):
  rel = dotted.replace(".", "/")
  for cand in (rel + ".py", rel + "/__init__.py"):
    if os.path.isfile(os.path.join(ROOT, cand)):
      return cand
  return None


@functools.lru_cache(maxsize=None)
def _top_level(path):
  """Names a module defines, assigns or imports at its top level -> the ClassDef node or None."""
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = {}

  def visit(body):
    for node in body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names[node.name] = None
      elif isinstance(node, ast.ClassDef):
        names[node.name] = node
      elif isinstance(node, ast.Assign):
        for t in node.targets:
          for n in ast.walk(t):
            if isinstance(n, ast.Name):
              names[n.id] = None
      elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
        names[node.target.id] = None
      elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for a in node.names:
          names[(a.asname or a.name).split(".")[0]] = None
      elif isinstance(node, (ast.If, ast.Try)):
        visit(node.body)
        visit(node.orelse)
        for h in getattr(node, "handlers", []):
          visit(h.body)
        visit(getattr(node, "finalbody", []))
  visit(tree.body)
  return names


def _class_members(node):
  out = set()
  for n in node.body:
    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out.add(n.name)
    elif isinstance(n, ast.Assign):
      out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
      out.add(n.target.id)
  return out


def _check_dotted(ref):
  """`pkg.mod.attr[.member]`: None if it resolves, else why not."""
  parts = ref.split("(", 1)[0].split(".")
  for i in range(len(parts), 0, -1):
    mod = _module_file(".".join(parts[:i]))
    if mod:
      break
  else:
    return "no such module"
  rest = parts[i:]
  if not rest:
    return None
  if len(rest) > 2:
    return None                       # deeper than is cheap to check
  top = _top_level(mod)
  if rest[0] not in top:
    if mod.endswith("__init__.py") and _module_file(".".join(parts[:i + 1])):
      return None
    return f"{mod} has no top-level {rest[0]}"
  if len(rest) == 2 and top[rest[0]] is not None and rest[1] not in _class_members(top[rest[0]]):
    return f"class {rest[0]} in {mod} has no {rest[1]}"
  return None


_CLASS_MEMBER = re.compile(r"^([A-Z]\w*)\.([A-Za-z_]\w*)(?:\(.*\))?$")


@functools.lru_cache(maxsize=None)
def _repo_classes():
  """Class name -> [(members, base names)] of every top-level class of the packages' modules (tests left out).
  Members: what the body defines or assigns, plus `self.x = ...` in its methods."""
  out = {}
  for pkg in PACKAGES:
    if pkg == "tests":
      continue
    for path in glob.glob(os.path.join(ROOT, pkg, "**", "*.py"), recursive=True):
      with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
      for node in tree.body:
        if not isinstance(node, ast.ClassDef):
          continue
        members = _class_members(node)
        for n in ast.walk(node):
          if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(
              n.ctx, ast.Store):
            members.add(n.attr)
        bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
        out.setdefault(node.name, []).append((members, bases))
  return out


def _check_class_member(ref):
  """`Class.member` for a class of the packages: None if some class of that name (or a base of it named in the
  packages) has the member, else why not; None for a name that is no class of the packages."""
  m = _CLASS_MEMBER.match(ref)
  classes = _repo_classes()
  if not m or m.group(1) not in classes:
    return None
  todo, seen = [m.group(1)], set()
  while todo:
    name = todo.pop()
    if name in seen or name not in classes:
      continue
    seen.add(name)
    for members, bases in classes[name]:
      if m.group(2) in members:
        return None
      todo += bases
  return f"no class {m.group(1)} of the packages has {m.group(2)}"


def find_problems():
  problems = []
  for doc in _docs():
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
      text = f.read()
    pieces, blanked = _code_pieces(text)
    seen = set()

    def report(line, kind, ref, why):
      key = (kind, ref)
      if key not in seen:
        seen.add(key)
        problems.append(f"{doc}:{line}: {kind} {ref}: {why}")

    test_dirs = []          # (offset, directory) of every path under tests/, for bare test file names after it
    for m in _PATH_IN_TEXT.finditer(text):
      for token in _expand(_strip(m.group(1))):
        why = _check_path(token)
        if why:
          report(_line_of(text, m.start(1)), "path", token, why)
        path = token.split("::", 1)[0]
        if path.startswith("tests/"):
          isdir = path.endswith("/") or os.path.isdir(os.path.join(ROOT, path))
          test_dirs.append((m.start(1), path.rstrip("/") if isdir else os.path.dirname(path)))
    for m in _INLINE.finditer(blanked):
      bare = _strip(m.group(1).strip())
      if re.fullmatch(r"test_\w+\.py", bare):
        before = [d for pos, d in test_dirs if pos < m.start()]
        where = before[-1] if before else "tests"
        if not os.path.isfile(os.path.join(ROOT, where, bare)):
          report(_line_of(text, m.start(1)), "test file", bare, f"not in {where}/, the last tests/ path before it")
    for line, piece in pieces:
      bare = _strip(piece.strip())
      if _DOTTED.match(bare):
        why = _check_dotted(bare)
        if why:
          report(line, "name", bare, why)
      for ref in re.split(r"\s*/\s*", bare):       # `A.x` / `A.y` names two
        why = _check_class_member(ref)
        if why:
          report(line, "member", ref, why)
    for m in _LINK.finditer(blanked):
      target = m.group(1).split("#", 1)[0]
      if not target or re.match(r"^[a-z]+:", target) or target.startswith("/"):
        continue
      rel = os.path.normpath(os.path.join(os.path.dirname(doc), target))
      if not os.path.exists(os.path.join(ROOT, rel)):
        report(_line_of(text, m.start(1)), "link", target, "missing")
    for m in _PYTHON_M.finditer(text):
      module = m.group(1).rstrip(".")
      if module.split(".")[0] in PACKAGES and not _module_file(module):
        report(_line_of(text, m.start(1)), "module", module, "no module file or package")
  return sorted(problems, key=lambda p: (p.split(":")[0], int(p.split(":")[1])))


def test_docs_name_only_what_exists():
  problems = find_problems()
  assert not problems, "documentation names things that do not exist:\n" + "\n".join(problems)


def test_the_checker_tells_present_from_missing():
  assert _check_path("tests/test_docs.py") is None
  assert _check_path("cache/no_such_file.py") == "missing"
  assert _check_path("tests/test_docs.py::test_docs_name_only_what_exists") is None
  assert _check_path("tests/test_docs.py::test_no_such_test").startswith("no def")
  assert _module_file("tests.test_docs") == "tests/test_docs.py"
  assert _check_dotted("tests.test_docs.find_problems") is None
  assert _check_dotted("tests.test_docs.no_such_name") is not None
  assert _check_class_member("KVCacheManager.plan") is None
  assert _check_class_member("KVCacheManager.no_such_method") is not None
  assert _check_class_member("Engine.async_active") is None          # assigned on self in a method
  assert _check_class_member("NotAClassHere.anything") is None
  found = [m.group(1) for m in _PATH_IN_TEXT.finditer(
      "`--out_dir=experiments/checkpoints/v4_retrieval` (docs/README.md), `out/serve/outputs.jsonl`, /tmp/kv,"
      ' "dsv4/kv/1", `tests/a.py::test_b[v4]`, experiments/results/topk.{csv,png}')]
  assert found == ["experiments/checkpoints/v4_retrieval", "docs/README.md", "tests/a.py::test_b[v4]",
                   "experiments/results/topk.{csv,png}"]
  assert _expand("r/t.{csv,png}") == ["r/t.csv", "r/t.png"]
  for root in GENERATED:
    assert not _PATH_IN_TEXT.search(f"`{root}x/y.json`")
