"""The Colab notebook runs top to bottom (on the CPU, a few steps), so it cannot rot."""

import json

import nbformat
from nbclient import NotebookClient

from conftest import ROOT


def test_colab_notebook_executes(mrpc_slice, tmp_path):
    nb = nbformat.read(ROOT / "notebooks" / "colab_tpu_mrpc.ipynb", as_version=4)
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    metrics = tmp_path / "metrics.json"
    params[0].source = (f"INSTALL = False\nBACKEND = 'cpu'\nMODEL = None\nDATA_DIR = {str(mrpc_slice)!r}\n"
                        f"MAX_STEPS = 4\nMETRICS_OUT = {str(metrics)!r}")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    m = json.loads(metrics.read_text())
    assert m["steps"] == 4 and m["eval"]["n"] == 48
    assert "dev accuracy" in nb.cells[-1].outputs[0]["text"]
