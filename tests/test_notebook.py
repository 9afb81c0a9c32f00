"""The Colab notebook runs top to bottom (on the CPU, a few steps), so it cannot rot."""

import json

import nbformat
from conftest import ROOT
from nbclient import NotebookClient


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


def test_notebook_launcher_forks_gloo_workers_from_a_cell(tmp_path):
    """A training function defined in a cell runs on two forked gloo workers, which end with
    the same parameters."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import torch\n"
        "from xla_train import Engine, notebook_launcher\n\n"
        "def train_fn(out):\n"
        "    engine = Engine(backend='cpu')\n"
        "    torch.manual_seed(engine.rank)  # different starts: prepare must align them\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    model, optimizer = engine.prepare(model, optimizer)\n"
        "    for _ in range(3):\n"
        "        engine.backward(model(torch.randn(8, 4)).pow(2).mean())\n"
        "        engine.optimizer_step(optimizer)\n"
        "        optimizer.zero_grad()\n"
        "    torch.save(engine.unwrap_model(model).state_dict(), f'{out}/rank{engine.rank}.pt')\n"
        "    print('world', engine.world_size)\n"),
        nbformat.v4.new_code_cell(f"notebook_launcher(train_fn, ({str(tmp_path)!r},), backend='cpu', num_processes=2)")]
    NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    import torch

    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
