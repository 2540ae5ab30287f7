"""Real-browser tests (JupyterLab + headless Chromium); a package so that its conftest does not
shadow tests/conftest.py, which other tests import helpers from."""
