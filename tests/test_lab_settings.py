"""JupyterLab's settings overrides (binder/overrides.json): no "Would you like to get notified about
Jupyter news?" prompt on a fresh start. The Makefile's venv target and binder/postBuild install them
with binder/install-lab-settings into <prefix>/share/jupyter/lab/settings/overrides.json, where
JupyterLab reads its defaults."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from browser_support import free_port, stop_process

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = REPO / "binder" / "overrides.json"
PLUGIN = "@jupyterlab/apputils-extension:notification"


def test_the_overrides_turn_the_news_prompt_off_and_match_jupyterlabs_schema():
    overrides = json.loads(OVERRIDES.read_text())
    assert overrides == {PLUGIN: {"fetchNews": "false"}}
    schema_file = Path(sys.prefix) / "share/jupyter/lab/schemas/@jupyterlab/apputils-extension/notification.json"
    if not schema_file.exists():
        pytest.skip("JupyterLab is not installed here (pip install -e '.[lab]')")
    prop = json.loads(schema_file.read_text())["properties"]["fetchNews"]
    # a string, as JupyterLab's schema spells it: "true" (Always) | "false" (Never) | "none" (Ask: the prompt)
    assert prop["type"] == "string" and {"const": "false", "title": "Never"} in prop["oneOf"]
    assert prop["default"] == "none"  # what a fresh start does without the overrides: ask


def test_install_script_and_makefile_put_them_where_jupyterlab_reads_them(tmp_path):
    prefix = tmp_path / "env"
    subprocess.run([str(REPO / "binder" / "install-lab-settings"), str(prefix)], check=True)
    installed = prefix / "share/jupyter/lab/settings/overrides.json"
    assert installed.read_text() == OVERRIDES.read_text()
    bad = subprocess.run([str(REPO / "binder" / "install-lab-settings")], capture_output=True, text=True)
    assert bad.returncode != 0 and "PREFIX" in bad.stderr
    # the Makefile's venv target installs them (into a venv whose packages are already installed)
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "workbench").touch()  # newer than pyproject.toml: no pip install
    subprocess.run(["make", "-C", str(REPO), f"VENV={venv}", "venv"], check=True, capture_output=True)
    assert (venv / "share/jupyter/lab/settings/overrides.json").read_text() == OVERRIDES.read_text()
    # binder/postBuild runs the same script on Binder's Python prefix
    post = (REPO / "binder" / "postBuild").read_text().splitlines()
    assert any(x.startswith("binder/install-lab-settings ") and "sys.prefix" in x for x in post)


@pytest.mark.slow
@pytest.mark.server
def test_jupyterlab_starts_with_the_news_prompt_off(tmp_path):
    """A real JupyterLab, given the installed settings folder and an empty user settings folder, serves
    fetchNews = "false" as the notification plugin's setting."""
    pytest.importorskip("jupyterlab", reason="pip install -e '.[lab]'")
    prefix = tmp_path / "env"
    subprocess.run([str(REPO / "binder" / "install-lab-settings"), str(prefix)], check=True)
    port, token = free_port(), "workbench-settings-test"
    env = os.environ | {"JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt")}
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={tmp_path}", "--allow-root",
        f"--LabApp.app_settings_dir={prefix / 'share/jupyter/lab/settings'}",
        f"--LabApp.user_settings_dir={tmp_path / 'user-settings'}",
    ]  # fmt: skip
    log = tmp_path / "jupyterlab.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    url = f"http://127.0.0.1:{port}/lab/api/settings/{PLUGIN}?token={token}"
    try:
        for _ in range(90):
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    settings = json.loads(r.read())
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("JupyterLab exited: " + log.read_text()[-2000:])
                time.sleep(1)
        else:
            pytest.fail("JupyterLab did not answer in 90 s: " + log.read_text()[-2000:])
    finally:
        stop_process(proc)
    # the override replaces the schema's default ("none": ask); no user setting was needed for it
    assert settings["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert "fetchNews" not in settings["settings"]
