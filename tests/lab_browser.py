"""A real JupyterLab driven by a real browser: Debian's chromium through Playwright.

``JupyterLab`` starts ``jupyter lab`` on loopback (a free port, a random token, ``--allow-root``)
in a folder of its own; ``Browser`` opens notebooks in headless chromium and does what a user
does: Run All, the stop button, restart the kernel, save, reload. Browser downloads can't be
reached here, so Playwright is pointed at ``/usr/bin/chromium`` (never ``playwright install``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.conftest import wait_until
from tests.slurm_cluster import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
#: The notebook's kernel is idle, as its toolbar's execution indicator shows it.
IDLE = ".jp-Notebook-ExecutionIndicator[data-status='idle']"


def browser_missing() -> str | None:
    """Why the browser tests can't run here, or ``None``."""
    if not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    for module in ("playwright", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[test]')"
    return None


class JupyterLab:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.log = self.root.parent / "jupyterlab.log"
        settings = self.root.parent / "lab-settings"
        # No "get notified about Jupyter news?" toast over the notebook (nor a network call for it).
        (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True, exist_ok=True)
        (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
            '{"fetchNews": "false", "checkForUpdates": false}')
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings),
                   JUPYTERLAB_WORKSPACES_DIR=str(self.root.parent / "lab-workspaces"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser", "--ip=127.0.0.1",
             f"--port={self.port}", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--ServerApp.port_retries=0"],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def answering() -> bool:
            try:
                urllib.request.urlopen(f"{self.base}/api/status?token={self.token}", timeout=2).read()
                return True
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"jupyter lab exited:\n{self.log.read_text()[-3000:]}") from None
                return False

        wait_until(answering, 60, "jupyter lab started (its /api/status answered)", every=0.3,
                   detail=lambda: self.log.read_text()[-3000:])

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, notebook: str) -> str:
        """The notebook alone in a workspace of its own (a reload shows it as it was saved)."""
        workspace = notebook.replace(".", "-")
        return f"{self.base}/lab/workspaces/{workspace}/tree/{notebook}?reset&token={self.token}"

    def shut_down_kernels(self) -> None:
        """Shut every kernel down (and the warm ranks each keeps), as File ▸ Shut Down All would: a test
        that is over leaves nothing running beside the next one."""
        api = f"{self.base}/api/kernels"
        for kernel in json.loads(urllib.request.urlopen(f"{api}?token={self.token}", timeout=10).read()):
            request = urllib.request.Request(f"{api}/{kernel['id']}?token={self.token}", method="DELETE")
            urllib.request.urlopen(request, timeout=30).read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Notebook:
    """One notebook open in a JupyterLab page."""

    def __init__(self, page, lab: JupyterLab, name: str) -> None:
        self.page, self.lab, self.name = page, lab, name

    def open(self) -> "Notebook":
        self.page.goto(self.lab.url(self.name))
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
        self.settle(60)
        return self

    def settle(self, timeout: float) -> None:
        """Wait until the notebook has its Python kernel, idle, and no dialog covers it.

        On a loaded machine JupyterLab can open a notebook before it has fetched the kernelspecs, find
        no kernel to start, and ask "Select Kernel" (seen once in CI, on a dialog that then stopped
        every click): a user picks the preferred kernel it offers, and so does this. Any other dialog
        is JupyterLab saying something went wrong: the test fails with its text."""

        def settled() -> bool:
            dialog = self.page.locator(".jp-Dialog")
            if dialog.count() and dialog.first.is_visible():
                text = dialog.first.inner_text()
                if not text.startswith("Select Kernel"):
                    raise AssertionError(f"JupyterLab showed a dialog over the notebook:\n{text}")
                dialog.first.locator(".jp-Dialog-button.jp-mod-accept").click()
                return False
            return bool(self.page.locator(IDLE).count()) and \
                "Python 3" in self.page.locator(".jp-NotebookPanel-toolbar").inner_text()

        wait_until(settled, timeout, "the notebook's Python 3 kernel idle, no dialog over it", every=0.2,
                   detail=lambda: f"its toolbar: {self.page.locator('.jp-NotebookPanel-toolbar').inner_text()!r}")

    def wait_idle(self, timeout: float) -> None:
        self.page.wait_for_selector(IDLE, timeout=timeout * 1000)

    def command(self, name: str) -> None:
        """Run a JupyterLab command from its toolbar button or menu entry (what a user clicks)."""
        self.page.locator(f".jp-NotebookPanel-toolbar [data-command='{name}']").first.click()

    def run_all(self, attempts: int = 3) -> None:
        """Run ▸ Run All Cells, as a user clicks it; again if the first cell didn't start.

        On a machine where JupyterLab runs for the first time, the kernel can report idle before the
        page's session is wired to it, and the menu command then does nothing (seen once in the full
        tier): a user would click again, and so does this."""
        started = ("() => { const p = document.querySelector('.jp-Notebook .jp-Cell .jp-InputPrompt');"
                   " return !!p && /[0-9*]/.test(p.innerText); }")
        for attempt in range(attempts):
            self.settle(60)
            self.page.locator(".jp-Notebook .jp-Cell").first.click()  # the notebook has the focus, as after a click
            self.page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
            self.page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
            try:
                self.page.wait_for_function(started, timeout=15_000)
                return
            except Exception:
                if attempt == attempts - 1:
                    raise

    def restart_kernel(self) -> None:
        self.command("notebook:restart-kernel")
        self.page.locator(".jp-Dialog-button.jp-mod-accept").click()

    def save(self) -> None:
        self.page.keyboard.press("Control+s")
        self.page.wait_for_function(
            "() => !document.querySelector('.jp-mod-current .jp-mod-dirty, .lm-TabBar-tab.jp-mod-current.jp-mod-dirty')",
            timeout=30_000)

    def output_text(self, cell: int) -> str:
        return self.page.locator(".jp-Notebook .jp-Cell").nth(cell).locator(".jp-OutputArea").inner_text()


def open_browser(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def copy_notebook(source: Path, root: Path, name: str) -> str:
    shutil.copy(source, root / name)
    return name
