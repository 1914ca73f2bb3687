"""experiments/notebooks/tour.ipynb runs top to bottom (nbclient, kernel = this interpreter) and is up to date with
its builder."""

import os
import sys

import ipykernel  # noqa: F401  (the notebook's kernel; a test dependency, never optional)
import nbclient
import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NB = os.path.join(REPO, "experiments", "notebooks", "tour.ipynb")
sys.path.insert(0, os.path.join(REPO, "experiments", "notebooks"))


def test_notebook_matches_builder():
  import build_tour
  nb = nbformat.read(NB, as_version=4)
  assert [c.source for c in nb.cells] == [c.source for c in build_tour.build().cells]


def test_notebook_runs(tmp_path):
  from jupyter_client.kernelspec import NATIVE_KERNEL_NAME
  nb = nbformat.read(NB, as_version=4)
  env_path = os.environ.get("PYTHONPATH", "")
  os.environ["PYTHONPATH"] = REPO + (os.pathsep + env_path if env_path else "")
  try:
    # NATIVE_KERNEL_NAME ("python3") runs the kernel with sys.executable, i.e. the test's interpreter.
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name=NATIVE_KERNEL_NAME,
                                     resources={"metadata": {"path": REPO}})
    client.execute()
  finally:
    os.environ["PYTHONPATH"] = env_path
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
  assert "model:" in text and "topk_ids" in text and "window_kv" in text
  assert "top-k 2:" in text and "logits identical: True" in text     # the layer swap changed the engine's output
  images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
  assert len(images) >= 2                     # the indexer heatmap and the ablation plot
  nbformat.write(nb, str(tmp_path / "tour.executed.ipynb"))
