"""The chat page in headless Chromium at a phone's size (Debian's `chromium` and `chromium-driver`,
driven by Selenium; run.sh installs them on a fresh machine when it can): an answer streams in,
Stop cancels one on the server, the conversation survives a reload, the load shows. Leaves a
screenshot in bench/out/webchat-phone.png (docs/webchat-phone.png is one such picture)."""
import json
import os
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from edgepaged.testing import serving as box

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "bench" / "out" / "webchat-phone.png"
PHONE = {"width": 390, "height": 844, "pixelRatio": 2}   # an ordinary phone, in CSS pixels


def browser_problem() -> tuple[str | None, str | None, str | None]:
    """(chromium, chromedriver, why not)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, None, "selenium is not installed"
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or next((p for p in ("/usr/lib/chromium/chromedriver",)
                                                   if os.path.exists(p)), None)
    if not chromium or not driver:
        return chromium, driver, "no chromium/chromedriver (Debian: apt-get install chromium chromium-driver)"
    return chromium, driver, None


@asynccontextmanager
async def serving(runner):
    async with box.serving(runner, http=True, max_num_seqs=8) as server:
        yield server.http


def open_phone_browser(chromium: str, driver_path: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")    # never let Selenium Manager go looking on the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--hide-scrollbars"):
        opts.add_argument(arg)
    opts.add_experimental_option("mobileEmulation", {
        "deviceMetrics": PHONE,
        "userAgent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko) "
                     "Chrome/126.0 Mobile Safari/537.36"})
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))


def wait(driver, condition, timeout=60, every=0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = condition(driver)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; page text:\n{driver.find_element('tag name', 'body').text}")
        time.sleep(every)


def last_answer(driver) -> dict:
    return driver.execute_script("""
        const all = document.querySelectorAll('.msg.assistant');
        const m = all[all.length - 1];
        return m ? {text: m.querySelector('.text').textContent, done: m.dataset.done || null,
                    meta: (m.querySelector('.meta') || {}).textContent || ''} : null;""")


def phone_scenario(base: str, chromium: str, driver_path: str) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    out = {}
    driver = open_phone_browser(chromium, driver_path)
    try:
        driver.get(base + "/")
        out["viewport"] = driver.execute_script("return [window.innerWidth, window.innerHeight]")
        wait(driver, lambda d: "running" in d.find_element(By.ID, "load-text").text)   # the load shows
        # settings: greedy and short, the way a user would set them
        driver.find_element(By.ID, "settings-button").click()
        for field, value in (("temperature", "0"), ("max-tokens", "24")):
            el = driver.find_element(By.ID, field)
            el.clear()
            el.send_keys(value, Keys.TAB)
        driver.find_element(By.ID, "settings-button").click()

        box = driver.find_element(By.ID, "input")
        box.send_keys("What is the capital of France?", Keys.ENTER)
        seen = []
        while True:   # watch the answer grow
            a = wait(driver, last_answer, every=0.01)
            if a["text"] and (not seen or seen[-1] != a["text"]):
                seen.append(a["text"])
            if a["done"]:
                break
            time.sleep(0.01)
        out["first"], out["partials"] = a, seen
        wait(driver, lambda d: d.find_element(By.ID, "send").text == "Send")
        time.sleep(2.2)   # one more load poll, then the picture
        out["load"] = driver.find_element(By.ID, "load-text").text
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(SCREENSHOT))

        # a long answer, stopped with the Stop button
        driver.find_element(By.ID, "settings-button").click()
        el = driver.find_element(By.ID, "max-tokens")
        el.clear()
        el.send_keys("400", Keys.TAB)
        driver.find_element(By.ID, "settings-button").click()
        driver.find_element(By.ID, "input").send_keys("Write a very long story about a dragon who learns to cook.",
                                                      Keys.ENTER)
        wait(driver, lambda d: len((last_answer(d) or {}).get("text", "")) > 20)
        out["stop_label"] = driver.find_element(By.ID, "send").text
        driver.find_element(By.ID, "send").click()
        out["stopped"] = wait(driver, lambda d: (a := last_answer(d)) and a["done"] and a)

        driver.refresh()   # the conversation is kept
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.user"))
        out["after_reload"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg")]
        out["resources"] = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        out["console"] = [e["message"] for e in driver.get_log("browser")]
        out["overflow_x"] = driver.execute_script(
            "return document.documentElement.scrollWidth > window.innerWidth")
    finally:
        driver.quit()
    return out


async def test_the_chat_page_on_a_phone(embedded_runner):
    chromium, driver_path, problem = browser_problem()
    if problem:
        print(f"skipping the browser test: {problem}")
        pytest.skip(problem)
    async with serving(embedded_runner) as http:
        base = f"http://127.0.0.1:{http.port}"
        with trio.fail_after(150):
            out = await trio.to_thread.run_sync(phone_scenario, base, chromium, driver_path)
        stats = http.engine.stats()
    print(json.dumps({k: v for k, v in out.items() if k != "console"}, indent=1)[:3000])
    assert out["viewport"] == [PHONE["width"], PHONE["height"]]
    first = out["first"]
    assert first["done"] == "1" and "Paris" in first["text"], first
    assert len(out["partials"]) >= 3, out["partials"]          # it streamed in, piece by piece
    assert "tokens" in first["meta"]
    assert "running" in out["load"] and "KV" in out["load"]
    assert out["stop_label"] == "Stop" and out["stopped"]["done"] == "stopped"
    assert stats["kv_blocks_used"] == 0 and stats["finished"]["cancelled"] == 1   # Stop cancelled it on the server
    texts = out["after_reload"]
    assert len(texts) == 4 and "capital of France" in texts[0] and "Paris" in texts[1]
    assert all(r.startswith(base + "/") for r in out["resources"]), out["resources"]
    assert not [m for m in out["console"] if "Content Security Policy" in m or "SEVERE" in m and "favicon" in m]
    assert not out["overflow_x"]                                # nothing wider than the phone
    assert SCREENSHOT.exists() and SCREENSHOT.stat().st_size < 200_000
