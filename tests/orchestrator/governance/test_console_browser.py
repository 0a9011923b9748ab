"""The console in a real headless browser (Debian's Chromium, driven by Selenium through
Debian's chromedriver: nothing is downloaded), against a real `serve` on 127.0.0.1: log in with
a key, watch an execution appear, approve a waiting tool call and see the code go on, filter the
audit log; a wrong key is refused, a revoked key logged out. Each page is kept as a screenshot
under test-artifacts/console/ (scripts/console-screenshots.sh copies the docs' ones to
docs/images/)."""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from orchestrator.cli import app as cli_app
from tests.orchestrator.governance.conftest import (
    ADMIN_KEY,
    KEY_A,
    CliResult,
    eventually,
    unique_name,
)
from tests.orchestrator.service.conftest import Server, make_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOTS = Path(__file__).parents[3] / "test-artifacts" / "console"
DOCS = Path(__file__).parents[3] / "docs" / "governance.md"
WAIT_S = 30.0
MAX_SHOT_HEIGHT = 2000
# No call home: the browser talks to the server on 127.0.0.1 and nothing else.
QUIET = (
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--disable-extensions",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
    "--no-first-run",
    "--hide-scrollbars",
    "--no-default-browser-check",
    "--metrics-recording-only",
    "--safebrowsing-disable-auto-update",
)

pytest.importorskip("selenium")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service as ChromeService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions as shown  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


def require_chromium() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if not missing:
        return
    why = f"{' and '.join(missing)} missing: run scripts/install-system-packages.sh"
    if os.environ.get("CI"):
        pytest.fail(f"the console's browser tests must run in CI: {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    require_chromium()
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", *QUIET):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,900")
    # Both paths given and offline: Selenium Manager has nothing to look up or download.
    offline = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"
    try:
        driver = webdriver.Chrome(options=options, service=ChromeService(str(CHROMEDRIVER)))
    finally:
        if offline is None:
            os.environ.pop("SE_OFFLINE", None)
        else:
            os.environ["SE_OFFLINE"] = offline
    driver.set_page_load_timeout(WAIT_S)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait(driver: WebDriver, condition: Callable[[Any], Any], within_s: float = WAIT_S) -> Any:
    return WebDriverWait(driver, within_s, poll_frequency=0.1).until(condition)


def text_shown(driver: WebDriver, css: str, text: str) -> None:
    wait(driver, shown.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))


def screenshot(driver: WebDriver, name: str) -> None:
    """A page as a reader sees it, whole (up to MAX_SHOT_HEIGHT), through the DevTools
    protocol: a headless window is no taller than its screen."""
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": size["width"], "scale": 1}
    clip["height"] = min(size["height"], MAX_SHOT_HEIGHT)
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
    )
    (SCREENSHOTS / f"{name}.png").write_bytes(base64.b64decode(shot["data"]))


def log_in(driver: WebDriver, server: Server, key: str) -> None:
    driver.delete_all_cookies()
    driver.get(f"{server.url}/console/login")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login").click()
    wait(driver, shown.url_contains("/console/sessions"))
    wait(driver, shown.presence_of_element_located((By.ID, "who")))


def test_a_wrong_key_is_refused_and_a_right_one_logs_in(
    browser: WebDriver, governed_server: Server
) -> None:
    browser.delete_all_cookies()
    browser.get(f"{governed_server.url}/console/sessions")
    wait(browser, shown.url_contains("/console/login?why=none"))
    browser.find_element(By.ID, "key").send_keys("not-a-key-of-this-service")
    browser.find_element(By.ID, "login").click()
    text_shown(browser, "#message", "That key does not work here")
    screenshot(browser, "console-login")
    log_in(browser, governed_server, ADMIN_KEY)
    assert "admin" in browser.find_element(By.ID, "who").text
    # The cookie is out of the page's scripts' reach.
    assert browser.execute_script("return document.cookie") == ""


def test_an_execution_appears_on_its_sessions_page_as_it_runs(
    browser: WebDriver, governed_server: Server, api: Callable[[str], httpx.Client]
) -> None:
    owner = api(KEY_A)
    log_in(browser, governed_server, ADMIN_KEY)
    sid = owner.post("/v1/sessions", json={"backend": "local"}).json()["id"]
    # The list is live: the new session shows without a reload.
    wait(browser, shown.presence_of_element_located((By.CSS_SELECTOR, f'tr[data-session="{sid}"]')))
    screenshot(browser, "console-sessions")
    browser.find_element(By.CSS_SELECTOR, f'a[href$="/sessions/{sid}"]').click()
    wait(browser, shown.presence_of_element_located((By.ID, "activity")))
    code = (
        "import matplotlib.pyplot as plt\n"
        "total = sum(range(101))\n"
        "print(f'the sum of 0..100 is {total}')\n"
        "plt.figure(figsize=(4, 2.5)); plt.plot([3, 1, 4, 1, 5, 9, 2, 6]); plt.title('a plot')\n"
        "plt.show()"
    )
    ran = owner.post(f"/v1/sessions/{sid}/execute", json={"code": code}).json()
    assert ran["status"] == "ok", ran
    text_shown(browser, "#activity pre.stdout", "the sum of 0..100 is 5050")
    image = wait(
        browser, shown.visibility_of_element_located((By.CSS_SELECTOR, "#activity img.artifact"))
    )
    wait(browser, lambda d: d.execute_script("return arguments[0].naturalWidth", image) > 0)
    assert "total = sum(range(101))" in browser.find_element(By.CSS_SELECTOR, "pre.code").text
    screenshot(browser, "console-session")


def worked_example(kind: str, holding: str) -> str:
    """The code block of docs/governance.md's worked example (``` + `kind`) that holds
    `holding`, as a reader copies it (the list's indentation taken off)."""
    doc = DOCS.read_text()
    example = doc[doc.index("## A worked example") :]
    blocks = re.findall(rf"^( *)```{kind}\n(.*?)^ *```$", example, re.M | re.S)
    [found] = [textwrap.dedent(body) for _, body in blocks if holding in body]
    return found


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the worked example runs: its invoices.py, as the docs give it."""
    where = tmp_path_factory.mktemp("worked-example")
    (where / "invoices.py").write_text(worked_example("python", "def pay_invoice"))
    return where


@pytest.fixture(scope="module")
def example_server(example_dir: Path) -> Iterator[Server]:
    """The worked example's service: its tool registered, no key in its settings."""
    serve = worked_example("sh", "code-interpreter serve")
    tools = '{"python": ["invoices:TOOLS"]}'
    assert f"CODE_INTERPRETER_HOST_TOOLS='{tools}'" in serve and "PYTHONPATH=$PWD" in serve
    server = make_server(host_tools=tools, backends="local", default_backend="local")
    del server.env["CODE_INTERPRETER_API_KEYS"]
    server.env["PYTHONPATH"] = str(example_dir)
    server.start()
    yield server
    assert server.stop() in (0, -signal.SIGTERM)
    shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def test_the_worked_example_runs_as_written(
    browser: WebDriver, example_server: Server, example_dir: Path
) -> None:
    """docs/governance.md's worked example, step by step: the keys made by its commands, its
    agent.py waiting on the tool, Alice approving in the console (its screenshots), the log."""
    state = ["--state-dir", str(example_server.state_dir)]
    for line in worked_example("sh", "keys add agent").replace("\\\n", " ").splitlines():
        command, _, into = line.partition(">")
        words = shlex.split(command)
        assert words[0] == "code-interpreter"
        made = CliRunner().invoke(cli_app, [*words[1:], *state])
        assert made.exit_code == 0, made.stderr
        (example_dir / into.strip()).write_text(made.stdout)
    agent_key = (example_dir / "agent.key").read_text().strip()
    with example_server.client(agent_key) as api:  # taken within a second, as the CLI says
        assert eventually(lambda: api.get("/v1/whoami").status_code == 200)
    agent = worked_example("python", "from code_interpreter_client")
    assert "http://127.0.0.1:8000" in agent
    (example_dir / "agent.py").write_text(
        agent.replace("http://127.0.0.1:8000", example_server.url)
    )
    run = subprocess.Popen(
        [sys.executable, "agent.py"], cwd=example_dir, stdout=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout is not None
        first = run.stdout.readline()
        assert first.startswith("session s-") and "waits for a human's yes" in first
        sid = first.split()[1]
        log_in(browser, example_server, (example_dir / "alice.key").read_text().strip())
        browser.get(f"{example_server.url}/console/approvals")
        mine = f"//article[contains(@class, 'pending')][.//a[contains(@href, '/sessions/{sid}')]]"
        pending = wait(browser, shown.visibility_of_element_located((By.XPATH, mine)))
        approval_id = pending.get_attribute("data-approval")
        assert "agent" in pending.text and "pay_invoice" in pending.text
        assert '"invoice": "INV-1234"' in pending.text and "host_tools.pay_invoice(" in pending.text
        assert run.poll() is None  # the code waits for the answer
        browser.find_element(By.ID, f"reason-{approval_id}").send_keys("invoice checked")
        screenshot(browser, "console-approvals")
        browser.find_element(By.ID, f"approve-{approval_id}").click()
        text_shown(browser, "#message", "Approved")
        out, _ = run.communicate(timeout=WAIT_S)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0
    assert out.splitlines() == [
        "the tool answered: paid INV-1234: 123400 cents",
        "pay_invoice approved by alice invoice checked",
    ]
    browser.get(f"{example_server.url}/console/sessions/{sid}")
    text_shown(browser, "#activity pre.stdout", "the tool answered: paid INV-1234")
    text_shown(browser, "#activity", "approval.decided")
    events = browser.find_element(By.ID, "activity").text
    assert "tool.call" in events and "invoice checked" in events
    screenshot(browser, "console-approved")
    audit = worked_example("sh", "audit list").strip()
    assert audit == "code-interpreter audit list --session s-..."
    listed = CliRunner().invoke(cli_app, ["audit", "list", "--session", sid, *state])
    assert listed.exit_code == 0, listed.stderr
    kinds = [line.split()[3] for line in listed.stdout.splitlines()]
    for kind in ("session.created", "approval.requested", "approval.decided", "tool.call"):
        assert kind in kinds, listed.stdout


def test_the_audit_log_is_filtered_in_the_page(
    browser: WebDriver, governed_server: Server, api: Callable[[str], httpx.Client]
) -> None:
    owner = api(KEY_A)
    sid = owner.post("/v1/sessions", json={"backend": "local"}).json()["id"]
    owner.post(f"/v1/sessions/{sid}/execute", json={"code": "print('audited')"})
    owner.post(f"/v1/sessions/{sid}/files", files={"file": ("notes.txt", b"kept")})
    log_in(browser, governed_server, ADMIN_KEY)
    browser.get(f"{governed_server.url}/console/audit")
    browser.find_element(By.ID, "filter-session").send_keys(sid)
    browser.find_element(By.ID, "filter").click()
    wait(browser, shown.url_contains(f"session={sid}"))

    def kinds() -> list[str]:
        rows = browser.find_elements(By.CSS_SELECTOR, "#events tbody tr")
        return [str(row.get_attribute("data-kind")) for row in rows]

    # Events are written a moment after they happen: the page is read again until they are.
    every = ["file.upload", "execution", "session.created"]

    def all_written(_: object) -> bool:
        if kinds() == every:
            return True
        browser.refresh()
        return False

    wait(browser, all_written)
    screenshot(browser, "console-audit")
    for kind in ("execution", "file.upload"):
        Select(browser.find_element(By.ID, "filter-kind")).select_by_value(kind)
        browser.find_element(By.ID, "filter").click()
        wait(browser, shown.url_contains(f"kind={kind}"))
        assert kinds() == [kind]
        assert browser.find_element(By.ID, "filter-session").get_attribute("value") == sid
    assert "notes.txt" in browser.find_element(By.ID, "events").text


def test_a_revoked_key_is_logged_out_of_an_open_page(
    browser: WebDriver,
    governed_server: Server,
    add_key: Callable[..., str],
    keys: Callable[..., CliResult],
) -> None:
    name = unique_name("reviewer")
    log_in(browser, governed_server, add_key(name))
    assert browser.find_element(By.ID, "who").text == name
    assert keys("revoke", name).exit_code == 0
    # The page is left open: its next poll sends it to the login form.
    wait(browser, shown.url_contains("/console/login?why=revoked"))
    text_shown(browser, "#message", "no longer works")
    screenshot(browser, "console-logged-out")
