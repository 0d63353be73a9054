"""``%%ddp_train`` in a real JupyterLab, in a real browser (headless chromium via Playwright).

What a user sees: Run All, the live view while 2 gloo ranks train, the static copy it leaves, the
notebook saved and reloaded, the stop button and a kernel restart mid-run. ``.ci/run`` installs
chromium and sets NBDDP_REQUIRE_BROWSER=1, so these can't be skipped there. With
NBDDP_SCREENSHOTS=DIR the run writes the documentation's screenshots into DIR (``tests.conftest.docs_image``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nbddp.contracts.pool_dir import FOLDER_PREFIX, JobEnd, PoolDir
from tests.conftest import code, docs_image, wait_until, write_notebook
from tests.lab_browser import JupyterLab, Notebook, browser_missing, open_browser

pytestmark = pytest.mark.slow

if browser_missing():
    if os.environ.get("NBDDP_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"NBDDP_REQUIRE_BROWSER=1 but {browser_missing()}")
    pytest.skip(browser_missing(), allow_module_level=True)

EPOCHS = 30
SETUP = """#| ddp
import time, torch, nbddp
from torch import nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
X = torch.randn(64, 4)
y = X.sum(1, keepdim=True)"""
TRAIN = f"""%%ddp_train --cpu
ddp = nbddp.prepare(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for epoch in range({EPOCHS}):
    loss = nn.functional.mse_loss(ddp(X), y)
    opt.zero_grad(); loss.backward(); opt.step()
    nbddp.log(epoch=epoch + 1, epochs={EPOCHS}, loss=loss.item())
    print(f"epoch {{epoch + 1}} loss {{loss.item():.4f}}")
    time.sleep(0.4)"""
EVALUATE = "print('kernel sees weight sum', round(float(model.weight.detach().sum()), 3))\n%ddp_ranks"
VIEW = ".nbddp-view"
ALL_RANKS_PANE = ".nbddp-view .nbddp-pane"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab") / "notebooks"
    root.mkdir()
    server = JupyterLab(root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = open_browser(playwright)
        yield browser
        browser.close()


@pytest.fixture
def notebook(lab, browser, request):
    name = f"{request.node.name.replace('test_', '')}.ipynb"
    write_notebook(lab.root / name, [code("%load_ext nbddp"), code(SETUP), code(TRAIN), code(EVALUATE)])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    yield Notebook(page, lab, name).open()
    page.close()
    lab.shut_down_kernels()


def run_dirs(root: Path, name: str) -> list[Path]:
    return sorted((root / "runs").glob(f"{Path(name).stem}-*"))


def run_processes(run_dir: Path) -> set[int]:
    """The run's ranks and their launcher (torchrun and its guard), while they run.

    Warm ranks are started once per kernel: their command lines and environments don't name the
    run, so they are found from the pids the ranks recorded, then up to the kernel that started them.
    """
    pids = set()
    for info in (run_dir / "ranks").glob("rank-*.json"):
        proc = psutil.Process(json.loads(info.read_text())["pid"])
        while proc is not None and "ipykernel" not in " ".join(proc.cmdline()):
            pids.add(proc.pid)
            proc = proc.parent()
    return pids


def pool_of(pids: set[int]) -> PoolDir:
    """The warm pool the run's processes belong to: its folder is their starter's argument."""
    for pid in pids:
        for arg in psutil.Process(pid).cmdline():
            if Path(arg).name.startswith(FOLDER_PREFIX):
                return PoolDir(Path(arg))
    raise AssertionError(f"no warm pool among {pids}")


def no_processes_left(pids: set[int], within: float = 15.0) -> None:
    def running() -> set[int]:
        return {p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}

    wait_until(lambda: not running(), within, "the run's processes ended", every=0.3, detail=lambda: running())


def start_training(notebook, lab, after: Path | None = None) -> tuple[Path, set[int]]:
    """Run All; once both ranks print: the run dir (the one besides ``after``'s) and the run's processes."""
    notebook.run_all()
    notebook.page.wait_for_selector(VIEW, timeout=90_000)
    wait_for_both_ranks(notebook.page)
    [run_dir] = [d for d in run_dirs(lab.root, notebook.name) if d != after]
    pids = run_processes(run_dir)
    assert len(pids) >= 3, pids  # two ranks and their launcher
    return run_dir, pids


def wait_for_both_ranks(page) -> None:
    page.wait_for_function(
        f"() => {{ const t = document.querySelector('{ALL_RANKS_PANE}')?.innerText || '';"
        " return t.includes('[rank 0] epoch') && t.includes('[rank 1] epoch'); }", timeout=90_000)


def progress(page) -> float:
    """The bar's filled fraction, as drawn."""
    return page.evaluate(f"""() => {{
        const bar = document.querySelector('{VIEW} .progress-bar');
        return bar.getBoundingClientRect().width / bar.parentElement.getBoundingClientRect().width; }}""")


def plot_points(page) -> int:
    return page.evaluate(f"() => document.querySelectorAll('{VIEW} svg.nbddp-plot circle').length")


def screenshot(page, name: str, element=None) -> None:
    """The page (or one ``element`` of it) as the documentation shows it, when asked to (``docs_image``)."""
    path = docs_image(name)
    if path is not None:
        (element or page).screenshot(path=str(path))


def test_live_view_updates_in_place_then_leaves_a_copy_that_survives_reload(notebook, lab):
    page = notebook.page
    notebook.run_all()
    page.wait_for_selector(VIEW, timeout=90_000)
    wait_for_both_ranks(page)
    page.wait_for_selector(f"{VIEW} svg.nbddp-plot", timeout=30_000)
    pane = page.query_selector(ALL_RANKS_PANE)
    first_chunk = page.query_selector(f"{ALL_RANKS_PANE} pre.nbddp-lines")
    page.evaluate("(node) => window.getSelection().selectAllChildren(node)", first_chunk)  # a reader selects a line
    selected = page.evaluate("() => window.getSelection().toString()")
    before = (progress(page), plot_points(page))
    wait_until(lambda: progress(page) > before[0] and plot_points(page) > before[1], 30, "progress and plot advance",
               detail=lambda: (before, (progress(page), plot_points(page))))
    screenshot(page, "ddp_train_live.png")
    assert page.evaluate(f"(n) => n === document.querySelector('{ALL_RANKS_PANE}')", pane)  # the same DOM node
    assert first_chunk.evaluate("(n) => n.isConnected")  # old lines are never redrawn...
    assert page.evaluate("() => window.getSelection().toString()") == selected != ""  # ...so a selection stays
    status = page.inner_text(f"{VIEW} .nbddp-live")
    epoch_shown = int(re.search(r"epoch (\d+)/30", status).group(1))
    plotted = plot_points(page)
    assert abs(plotted - epoch_shown) <= 1, (status, plotted)  # the plot keeps pace with the status line
    # JupyterLab renders the widgets: the cell shows the ranks' lines once, in the view (no text copy beside it).
    outputs = page.locator(".jp-Notebook .jp-Cell").nth(2).locator(".jp-OutputArea-output")
    texts = [outputs.nth(i).inner_text() for i in range(outputs.count())]
    assert sum("[rank 1] epoch 1 loss" in text for text in texts) == 1, texts  # in the view only
    assert page.locator(".nbddp-text-copy").count() == 0

    page.wait_for_selector(".nbddp-snapshot", timeout=120_000)
    notebook.wait_idle(60)
    copy = page.inner_text(".nbddp-snapshot")
    assert "succeeded in" in copy and "model loaded on the CPU" in copy and "run dir runs/" in copy, copy
    assert "final metrics: loss=" in copy and "epoch=" not in copy
    assert "[rank 1] epoch 30" in copy
    assert "kernel sees weight sum" in notebook.output_text(3)
    ranks = notebook.output_text(3)  # %ddp_ranks, after the run: the ranks kept warm and what each keeps
    assert "2 warm ranks (" in ranks and "1 run(s)" in ranks and "rank 1: In [2] kept: X 1.02 kB" in ranks, ranks
    assert page.locator(f"{VIEW}").count() == 0
    screenshot(page, "ddp_train_done.png")
    screenshot(page, "ddp_ranks.png", page.locator(".jp-Notebook .jp-Cell").nth(3))

    notebook.save()
    page.reload()
    notebook.open()
    # (JupyterLab draws a reopened notebook's outputs after its cells, later still on a loaded machine: seen once in CI)
    page.wait_for_selector(".nbddp-snapshot img[alt='metrics']", timeout=60_000)
    assert page.locator(".nbddp-snapshot").count() == 1
    assert page.locator(".nbddp-snapshot img[alt='metrics']").count() == 1
    assert "Error displaying widget" not in page.inner_text(".jp-Notebook")
    assert "succeeded in" in notebook.output_text(2)

    # nbviewer's rendering (nbconvert's HTML, no kernel, no widget state): the copy and its plot show.
    html = lab.root / "exported.html"
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--output", str(html),
                    str(lab.root / notebook.name)], check=True, capture_output=True)
    page.goto(html.as_uri())
    assert "succeeded in" in page.inner_text(".nbddp-snapshot")
    assert page.evaluate("() => document.querySelector('.nbddp-snapshot img').naturalWidth") > 0


def test_stop_button_interrupts_within_seconds_then_a_kernel_restart_mid_run_leaves_nothing_running(notebook, lab):
    """Stop during a run: a short message within seconds, the warm ranks stay idle. Run All again, restart the
    kernel mid-run: the view says so and nothing of the run is left (one kernel and pool for both)."""
    page = notebook.page
    run_dir, pids = start_training(notebook, lab)
    started = time.monotonic()
    notebook.command("notebook:interrupt-kernel")
    error = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").first
    error.wait_for(timeout=10_000)
    assert time.monotonic() - started < 10
    text = error.inner_text()
    assert text.startswith("KeyboardInterrupt: the run was interrupted after") and str(run_dir) in text, text
    assert len(text.strip().splitlines()) <= 2 and "magics.py" not in text and "ddp_train" not in text, text
    assert "interrupted after" in page.inner_text(".nbddp-snapshot")
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    # Warm ranks stop the run and stay, idle, for the next one: each has left the job (its report says so, and
    # it writes one only once back in its loop) and is alive.
    pool = pool_of(pids)
    job = pool.jobs_handed_out() - 1
    wait_until(lambda: all(pool.job_exit(job, rank).exists() for rank in (0, 1)), 30,
               f"the ranks left job {job} of {pool}")
    assert {json.loads(pool.job_exit(job, rank).read_text())["status"] for rank in (0, 1)} == {JobEnd.INTERRUPTED.value}
    assert all(psutil.pid_exists(p) for p in pids)
    screenshot(page, "ddp_train_interrupted.png")

    notebook.wait_idle(60)
    _, pids = start_training(notebook, lab, after=run_dir)
    notebook.restart_kernel()
    page.locator(f"{VIEW} .nbddp-gone").wait_for(state="visible", timeout=30_000)
    assert "the kernel restarted: this run was stopped" in page.inner_text(f"{VIEW} .nbddp-gone")
    assert not page.locator(f"{VIEW} .nbddp-live").is_visible()
    no_processes_left(pids, within=20)
    notebook.wait_idle(60)


def test_a_notebook_executed_elsewhere_shows_its_copy_though_untrusted(lab, browser):
    """Run by nbclient (as papermill does), then opened in JupyterLab: unsigned, so its HTML is sanitized."""
    import nbformat
    from nbclient import NotebookClient

    name = "executed_elsewhere.ipynb"
    path = write_notebook(lab.root / name, [code("%load_ext nbddp"), code(SETUP),
                                            code(TRAIN.replace(f"range({EPOCHS})", "range(3)").replace("0.4", "0")),
                                            code(EVALUATE)])
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(lab.root)}}).execute()
    nbformat.write(nb, path)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        notebook = Notebook(page, lab, name).open()
        copy = page.locator(".nbddp-snapshot")
        copy.scroll_into_view_if_needed()
        assert "succeeded in" in copy.inner_text() and "Error displaying widget" not in page.inner_text(".jp-Notebook")
        page.wait_for_function("() => document.querySelector('.nbddp-snapshot img')?.naturalWidth > 0", timeout=10_000)
        assert "kernel sees weight sum" in notebook.output_text(3)
    finally:
        page.close()
