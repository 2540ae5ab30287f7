"""Fixtures for the real-browser tests: a private JupyterLab server and headless Chromium.

``lab`` starts JupyterLab on 127.0.0.1 (a free port, a random token, ``--allow-root`` because CI
runs as root) with fresh config / data / runtime / IPython directories under pytest's tmp dir and
three user settings: the default kernel starts without a dialog, every cell stays in the page (no
windowing: a test reads cells scrolled out of view), and no news is fetched. Its root holds this
folder's notebooks and a copy of ``lessons/`` (JupyterLab autosaves outputs into what it serves). Its
teardown deletes every session and kernel through the REST API and stops the server by PID,
also when the test failed. ``page`` is a Playwright page in ``/usr/bin/chromium`` with a fresh
profile; it records uncaught page errors in ``page.errors``, console errors in
``page.console_errors`` and every dialog in ``page.dialogs``, dismissing alerts, confirms and
prompts and accepting beforeunload (a navigation goes ahead).
Everything is skipped, with the reason, when Chromium is not installed (set ``AMPVIZ_CHROMIUM``
to use a Chromium elsewhere).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("AMPVIZ_CHROMIUM", "/usr/bin/chromium"))     # CI installs it with apt-get
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HERE = Path(__file__).resolve().parent
LESSONS = HERE.parents[1] / "lessons"
USER_SETTINGS = {
    "notebook-extension/tracker.jupyterlab-settings": {"autoStartDefaultKernel": True, "windowingMode": "none"},
    "apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
}


@dataclass
class Lab:
    """A running JupyterLab server."""

    url: str
    token: str
    root: Path
    process: subprocess.Popen
    log: Path

    def api(self, path: str, method: str = "GET"):
        """Call the server's REST API; returns the decoded JSON (None for an empty body)."""
        req = urllib.request.Request(f"{self.url}/api/{path}?token={self.token}", method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def api_post(self, path: str, body: dict):
        req = urllib.request.Request(f"{self.url}/api/{path}?token={self.token}", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def start_session(self, notebook: str) -> str:
        """Create the notebook's session with a python3 kernel; returns the kernel id.

        JupyterLab then attaches to this session instead of auto-starting a kernel while the page
        loads (a kernel it starts then may be shut down and replaced, dropping queued cells). The
        REST API reports the kernel "starting" until a client connects: the page waits for idle.
        """
        session = self.api_post("sessions", {"path": notebook, "type": "notebook", "name": notebook,
                                              "kernel": {"name": "python3"}})
        return session["kernel"]["id"]

    def kernel(self, notebook: str) -> dict:
        """The REST model of the notebook's kernel: ``execution_state`` and ``last_activity`` (the server
        updates both from every message the kernel publishes, widget updates included)."""
        session = next(s for s in self.api("sessions") if s["path"] == notebook)
        return self.api(f"kernels/{session['kernel']['id']}")

    def end_sessions(self, notebook: str | None = None) -> None:
        """Delete the notebook's sessions (every session when None), which shuts their kernels down."""
        for session in self.api("sessions"):
            if notebook is None or session["path"] == notebook:
                self.api(f"sessions/{session['id']}", method="DELETE")

    def lab_url(self, notebook: str) -> str:
        """The notebook in a workspace of its own: the default workspace would reopen every notebook an
        earlier test opened (each starting a kernel, their cells in the page too)."""
        workspace = re.sub(r"[^A-Za-z0-9]+", "-", notebook)
        return f"{self.url}/lab/workspaces/{workspace}/tree/{notebook}?token={self.token}"

    def kernel_events(self) -> list[str]:
        """The server log's kernel start / restart / shutdown lines."""
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if "Kernel started" in line or "Kernel shutdown" in line or "Kernel restarted" in line]

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fresh_jupyter_env(base: Path) -> dict:
    """Environment with private Jupyter / IPython dirs and the two user settings written."""
    env = dict(os.environ)
    for var, name in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"),
                      ("JUPYTER_RUNTIME_DIR", "runtime"), ("IPYTHONDIR", "ipython")):
        (base / name).mkdir(parents=True)
        env[var] = str(base / name)
    env["JUPYTERLAB_SETTINGS_DIR"] = str(base / "config" / "lab" / "user-settings")
    for rel, settings in USER_SETTINGS.items():
        target = base / "config" / "lab" / "user-settings" / "@jupyterlab" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(settings))
    env.pop("JUPYTER_TOKEN", None)
    return env


def _wait_until_up(lab: Lab, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {lab.process.returncode}:\n{lab.log_tail()}")
        try:
            lab.api("status")
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.25)       # nothing to wait on but the port: poll it
    raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s:\n{lab.log_tail()}")


def _stop(lab: Lab) -> None:
    """Delete sessions and kernels (kernels outlive the browser), then stop the server by PID."""
    try:
        lab.end_sessions()
        for kernel in lab.api("kernels"):
            lab.api(f"kernels/{kernel['id']}", method="DELETE")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        pass                       # the server is already gone; still make sure the process is
    if lab.process.poll() is None:
        lab.process.send_signal(signal.SIGTERM)
        try:
            lab.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            lab.process.kill()
            lab.process.wait(timeout=10)


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.skip(f"the browser test needs Chromium at {CHROMIUM} (CI installs it with apt-get; locally: "
                    "apt-get install chromium, or set AMPVIZ_CHROMIUM to its path)")
    return CHROMIUM


@pytest.fixture(scope="session")
def lab(chromium, tmp_path_factory):
    """A JupyterLab server whose root holds this folder's notebooks and a copy of ``lessons/``."""
    base = tmp_path_factory.mktemp("lab")
    root = base / "root"
    shutil.copytree(LESSONS, root / "lessons")
    for nb in HERE.glob("*.ipynb"):
        shutil.copy(nb, root / nb.name)
    env, token, port = _fresh_jupyter_env(base / "jupyter"), secrets.token_hex(16), _free_port()
    log = base / "lab.log"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--allow-root", "--no-browser", f"--port={port}",
           "--ip=127.0.0.1", "--ServerApp.port_retries=0", f"--ServerApp.token={token}",
           f"--ServerApp.root_dir={root}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)
    server = Lab(f"http://127.0.0.1:{port}", token, root, process, log)
    try:
        _wait_until_up(server)
        yield server
    finally:
        _stop(server)


@pytest.fixture
def page(chromium, tmp_path):
    """A Playwright page in headless Chromium with a fresh profile; uncaught errors in ``page.errors``,
    console errors in ``page.console_errors``, dialogs in ``page.dialogs`` (dismissed, except
    beforeunload: leaving the page goes ahead)."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=str(chromium), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1800})
        try:
            pg = context.pages[0] if context.pages else context.new_page()
            pg.errors, pg.console_errors, pg.dialogs = [], [], []
            pg.on("pageerror", lambda e: pg.errors.append(str(e)))
            pg.on("console", lambda m: pg.console_errors.append(m.text) if m.type == "error" else None)
            # a beforeunload dialog is accepted: dismissing it cancels the navigation the test asked for (goto
            # fails with net::ERR_ABORTED), and JupyterLab raises one whenever a notebook has unsaved outputs
            pg.on("dialog", lambda d: (pg.dialogs.append(f"{d.type}: {d.message}"),
                                       d.accept() if d.type == "beforeunload" else d.dismiss()))
            pg.set_default_timeout(60_000)
            yield pg
        finally:
            context.close()
