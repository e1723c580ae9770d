"""Issue 33 item 4: the console in a real browser (headless Chromium driven by Selenium).

One walk through a live gateway (the instant engine): the admin logs in, sees the usage plots
(the canvases are checked for drawn pixels in a screenshot), every page, creates and revokes a
key; a tenant uploads an adapter (with the progress bar) and deletes it, is refused another
tenant's URLs, and a page on another site that posts to the console (a CSRF attempt) changes
nothing. Skipped, saying why, without Debian's ``chromium`` and ``chromium-driver`` or Selenium
(``.ci/run`` installs them). ``LORAPLEX_CONSOLE_SCREENSHOT=path.png`` also saves the usage
page's screenshot (the README's, docs/console-usage.png).
"""

import io
import os
import shutil
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loraplex.gateway.db.types import utcnow
from loraplex.gateway.usage.records import UsageRecord, record_usage_batch
from tests.gateway.conftest import with_db
from tests.gateway.live import instant_gateway
from tests.gateway.test_console import tiny_adapter

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip(
    "selenium.webdriver", reason="selenium is not installed (the test extra brings it)"
)
if CHROMIUM is None or DRIVER is None:
    pytest.skip(
        "no browser: install Debian's chromium and chromium-driver (.ci/run does)",
        allow_module_level=True,
    )

from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as EC  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1100",
        "--no-proxy-server",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService(DRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


class EvilSite:
    """Another site (``localhost`` on another port) whose page posts a form to the console."""

    def __init__(self, target):
        page = (
            f'<html><body><form id="f" method="post" action="{target}">'
            '<input name="name" value="mallory"></form>'
            '<script>document.getElementById("f").submit()</script></body></html>'
        ).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://localhost:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def wait(driver, condition, timeout=10):
    """Until ``condition`` holds (an element htmx just swapped out is simply looked up again)."""
    return WebDriverWait(
        driver, timeout, ignored_exceptions=(StaleElementReferenceException,)
    ).until(condition)


def login(driver, base, key):
    driver.delete_all_cookies()
    driver.get(f"{base}/console/login")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login").click()
    wait(driver, EC.url_contains("/console/usage"))


def canvas_ink(driver, element):
    """Pixels of ``element``'s screenshot that are neither white nor the page's background."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(element.screenshot_as_png)).convert("RGB"))
    return int((pixels.min(axis=2) < 200).sum())


def seed_usage(live, tenant_id):
    """A day of one tenant's usage, a few requests an hour, ending now."""
    now = utcnow()

    async def body(sessions):
        records = [
            UsageRecord(
                request_id=f"seed-{h}-{i}",
                tenant_id=tenant_id,
                model="instant" if i % 3 else "support-bot",
                prompt_tokens=200 + 40 * h,
                completion_tokens=50 + 10 * i,
                cached_tokens=100 if i % 2 else 0,
                status="error" if (h + i) % 11 == 0 else "ok",
                latency_ms=80.0 + 15 * i + 3 * h,
                created_at=now - timedelta(hours=h, minutes=1 + i),
            )
            for h in range(24)
            for i in range(1 + h % 5)
        ]
        async with sessions() as s, s.begin():
            await record_usage_batch(s, records)

    with_db(live.state.config.db_url, body)


def test_the_console_in_a_real_browser(browser, tmp_path):
    t0 = time.monotonic()
    with instant_gateway(tmp_path / "data") as live:
        alpha, beta = live.create_tenant("alpha"), live.create_tenant("beta")
        seed_usage(live, alpha["id"])
        base = live.base_url
        d = browser

        # -- the admin: usage with plots
        login(d, base, live.admin_key)
        assert "admin (whole deployment)" in d.find_element(By.TAG_NAME, "header").text
        canvases = wait(d, lambda d: d.find_elements(By.CSS_SELECTOR, ".plot canvas"))
        assert len(canvases) == 3
        for plot_id in ("plot-requests", "plot-tokens", "plot-latency"):
            assert canvas_ink(d, d.find_element(By.ID, plot_id)) > 500, plot_id
        if os.environ.get("LORAPLEX_CONSOLE_SCREENSHOT"):
            d.save_screenshot(os.environ["LORAPLEX_CONSOLE_SCREENSHOT"])
        assert "alpha" in d.find_element(By.ID, "breakdown").text

        # -- keys: create one for alpha, then revoke it
        d.get(f"{base}/console/keys?tenant={alpha['id']}")
        d.find_element(By.ID, "create-key").click()
        new_key = wait(d, EC.presence_of_element_located((By.ID, "new-key"))).text
        assert new_key.startswith("lpx-")
        with live.client(new_key) as c:
            assert c.get("/v1/models").status_code == 200
        rows = d.find_elements(By.CSS_SELECTOR, "#keys tbody tr")
        assert len(rows) == 2
        rows[-1].find_element(By.CSS_SELECTOR, "button.revoke").click()
        d.switch_to.alert.accept()  # hx-confirm
        wait(d, lambda d: "revoked" in d.find_element(By.ID, "keys").text)
        with live.client(new_key) as c:
            assert c.get("/v1/models").status_code == 401

        # -- the engine page refreshes itself (htmx polling replaces the figures)
        d.get(f"{base}/console/engine")
        assert "running" in d.find_element(By.ID, "engine-health").text
        d.execute_script("document.getElementById('engine-figures').dataset.old = '1'")
        wait(
            d,
            lambda d: d.find_element(By.ID, "engine-figures").get_attribute("data-old") is None,
            timeout=6,
        )

        # -- a CSRF attempt: another site's page posts a form to the console
        evil = EvilSite(f"{base}/console/tenants")
        try:
            d.get(evil.url)
            time.sleep(0.5)
        finally:
            evil.close()
        with live.admin() as c:
            names = [t["name"] for t in c.get("/admin/tenants").json()["data"]]
        assert "mallory" not in names

        # -- a tenant: its adapters (upload with progress, delete), others' URLs refused
        d.get(f"{base}/console/usage")
        d.find_element(By.ID, "logout").click()
        wait(d, EC.url_contains("/console/login"))
        login(d, base, alpha["api_key"])
        d.get(f"{base}/console/adapters/")
        config, weights = tiny_adapter()
        (tmp_path / "adapter_config.json").write_bytes(config)
        (tmp_path / "adapter_model.safetensors").write_bytes(weights)
        d.find_element(By.ID, "adapter-name").send_keys("support-bot")
        d.find_element(By.ID, "adapter-files").send_keys(
            f"{tmp_path / 'adapter_config.json'}\n{tmp_path / 'adapter_model.safetensors'}"
        )
        d.find_element(By.ID, "upload-button").click()
        wait(d, EC.presence_of_element_located((By.ID, "uploaded")))
        row = d.find_element(By.CSS_SELECTOR, 'tr[data-adapter="support-bot"]').text
        assert "q_proj, v_proj" in row and "KiB" in row
        with live.client(alpha["api_key"]) as c:
            assert c.get("/v1/adapters/support-bot").status_code == 200
        d.find_element(By.CSS_SELECTOR, 'tr[data-adapter="support-bot"] button.delete').click()
        d.switch_to.alert.accept()
        wait(d, lambda d: not d.find_elements(By.CSS_SELECTOR, 'tr[data-adapter="support-bot"]'))
        with live.client(alpha["api_key"]) as c:
            assert c.get("/v1/adapters/support-bot").status_code == 404

        for path in (
            f"/console/usage?tenant={beta['id']}",
            f"/console/keys?tenant={beta['id']}",
            f"/console/adapters/?tenant={beta['id']}",
        ):
            d.get(base + path)
            assert "a tenant key sees its own tenant only" in d.find_element(By.ID, "error").text
        d.get(f"{base}/console/keys")
        assert beta["key_id"] not in d.page_source and alpha["key_id"] in d.page_source
    assert time.monotonic() - t0 < 30
