"""The demo notebook, executed headless in a real Jupyter kernel; launches in a kernel, interrupted too."""

import os
import re
from pathlib import Path

import nbformat
import pytest

nbclient = pytest.importorskip("nbclient")
jupyter_client = pytest.importorskip("jupyter_client")

ROOT = Path(__file__).parent.parent
NOTEBOOK = ROOT / "examples" / "train_gpt.ipynb"


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    """Kernels are subprocesses: make them import the threadpar under test, whatever else is installed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.output_type == "stream")


@pytest.mark.timeout(240)
def test_the_notebook_trains_plots_and_checkpoints(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "\n".join(stream_text(c) for c in nb.cells if c.cell_type == "code")
    assert "TP1[2,3]" in text  # the layout overview
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", text)]
    assert len(losses) == 2 and losses[1] < losses[0]  # the second launch continued training
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    plain = float(re.search(r"plain single-thread GPT from the checkpoint: loss ([0-9.]+)", text).group(1))
    assert abs(plain - losses[1]) < 0.5  # the checkpoint holds the trained model, not the initial one
    assert (tmp_path / "gpt_checkpoint.pt").stat().st_size > 0


@pytest.mark.timeout(120)
def test_an_interrupt_stops_every_rank_and_the_next_cell_runs():
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3")
    try:

        def run(code, timeout=60):
            msg_id = kc.execute(code)
            reply = kc.get_shell_msg(timeout=timeout)
            while reply["parent_header"].get("msg_id") != msg_id:
                reply = kc.get_shell_msg(timeout=timeout)
            return reply["content"]

        assert run("import threading, time, threadpar")["status"] == "ok"
        spin = (
            "def spin():\n"
            "    threadpar.print0('spinning')\n"
            "    while True:\n"
            "        time.sleep(0.01)\n"
            "threadpar.launch(spin, world_size=4, devices='cpu')"
        )
        # (stop_on_error=False: the kernel would abort the requests that follow the interrupted one, for as
        # long as its queue takes to drain, a race with the next cell on a busy machine; ipykernel's abort)
        msg_id = kc.execute(spin, stop_on_error=False)
        while "spinning" not in kc.get_iopub_msg(timeout=60)["content"].get("text", ""):
            pass  # (the ranks run: the interrupt reaches the launch, not the cell's start)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        alive = run("assert not [t for t in threading.enumerate() if t.name.startswith('threadpar-rank')]")
        assert alive["status"] == "ok", alive
        assert (
            run("assert threadpar.launch(threadpar.get_rank, world_size=2, devices='cpu') == [0, 1]")[
                "status"
            ]
            == "ok"
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
