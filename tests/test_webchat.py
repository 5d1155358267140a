"""The chat page in headless Chromium at a phone's size (Debian's `chromium` and `chromium-driver`,
driven by Selenium; run.sh installs them on a fresh machine when it can): an answer streams in,
Stop cancels one on the server, the conversation survives a reload, the load shows. Leaves a
screenshot in bench/out/webchat-phone.png (docs/webchat-phone.png is one such picture)."""
import json
import os
import shutil
import time
from contextlib import asynccontextmanager, contextmanager
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


def open_phone_browser(chromium: str, driver_path: str, phone: bool = True, size=(1280, 800)):
    """Headless Chromium as a phone (mobile emulation at PHONE's size) or as a desktop window."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")    # never let Selenium Manager go looking on the network
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                "--disable-extensions", "--disable-background-networking", "--hide-scrollbars"):
        opts.add_argument(arg)
    if phone:
        opts.add_experimental_option("mobileEmulation", {
            "deviceMetrics": PHONE,
            "userAgent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko) "
                         "Chrome/126.0 Mobile Safari/537.36"})
    else:
        opts.add_argument(f"--window-size={size[0]},{size[1]}")
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
        long_seen = []

        def grown(d):   # watch it grow, piece by piece, then stop it
            t = (last_answer(d) or {}).get("text", "")
            if t and (not long_seen or long_seen[-1] != t):
                long_seen.append(t)
            return len(long_seen) >= 3 and len(t) > 20
        wait(driver, grown, every=0.01)
        out["long_partials"] = list(long_seen)
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
    # it streams in, piece by piece: the long answer (the short one may come in two pieces
    # or one, its words drafted by prompt lookup from the question)
    assert out["partials"] and out["partials"][-1] == first["text"], out["partials"]
    growing = out["long_partials"]
    assert len(growing) >= 3 and len(growing[-1]) > len(growing[0]), growing
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


# ---- the page as llama.cpp's users expect it: Markdown, copy buttons, conversations, keys ----------------

CODE_QUESTION = "Show me a Python hello world program."   # the embedded model answers with a ```python block
HOSTILE = ("<img src=x onerror=\"window.pwned=1\">\n\n<script>window.pwned=2</script>\n\n"
           "[click me](javascript:window.pwned=3) and **bold** and <b onmouseover=\"window.pwned=4\">b</b>\n\n"
           "```html\n<script>window.pwned=5</script>\n```")


def _set(driver, **values):
    for key, value in values.items():
        driver.execute_script("localStorage.setItem(arguments[0], JSON.stringify(arguments[1]))",
                              "edgepaged." + key, value)


def _answer_done(driver):
    return (a := last_answer(driver)) and a["done"] and a


def _convs(driver) -> list[str]:
    return driver.execute_script("return [...document.querySelectorAll('#conversations .conv .open')]"
                                 ".map(b => b.textContent)")


def desktop_scenario(base: str, chromium: str, driver_path: str, shots: Path) -> dict:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    out = {}
    driver = open_phone_browser(chromium, driver_path, phone=False, size=(1280, 860))
    try:
        driver.get(base + "/")
        _set(driver, temperature=0, maxTokens=160)
        driver.refresh()
        wait(driver, lambda d: d.find_element(By.ID, "box-name").text)
        out["viewport"] = driver.execute_script("return [window.innerWidth, window.innerHeight]")
        out["header"] = {k: driver.find_element(By.ID, k).text for k in ("model-name", "box-name")}
        out["panel_shown"] = driver.find_element(By.ID, "panel").is_displayed()

        # a Markdown answer with a code block, and its copy button
        driver.find_element(By.ID, "input").send_keys(CODE_QUESTION, Keys.ENTER)
        out["code_answer"] = wait(driver, _answer_done)
        out["rendered"] = driver.execute_script("""
            const t = [...document.querySelectorAll('.msg.assistant .text')].pop();
            const pre = t.querySelector('pre'), code = pre && pre.querySelector('code');
            return {pre: !!pre, code: code ? code.textContent : null, lang: code ? code.className : null,
                    inline: t.querySelectorAll('p code').length, copy: pre ? !!pre.querySelector('button.copy') : false,
                    fence_left: t.textContent.includes('```')};""")
        try:
            driver.execute_cdp_cmd("Browser.grantPermissions", {
                "origin": base, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
        except Exception as e:                      # noqa: BLE001 - then only the label is checked
            out["grant"] = str(e)
        driver.find_element(By.CSS_SELECTOR, ".msg.assistant pre button.copy").click()
        out["copy_label"] = wait(driver, lambda d: (t := d.find_element(By.CSS_SELECTOR, "pre button.copy").text)
                                 != "Copy" and t, timeout=5)
        out["clipboard"] = driver.execute_async_script(
            "const done = arguments[0]; navigator.clipboard.readText().then(done, e => done('ERR ' + e))")
        out["widths"] = driver.execute_script("""
            const r = (s) => document.querySelector(s).getBoundingClientRect();
            return {thread: r('#thread').width, answer: r('.msg.assistant').width, page: window.innerWidth,
                    left: r('#thread').left, right: window.innerWidth - r('#thread').right,
                    panel: r('#panel').width};""")
        time.sleep(1.2)
        driver.save_screenshot(str(shots / "page-desktop.png"))

        # Shift+Enter is a new line, Enter sends; the status line is current within a second while it runs;
        # Escape stops the answer; then the status says idle within a second
        _set(driver, maxTokens=400)
        driver.refresh()
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        box_ = driver.find_element(By.ID, "input")
        box_.send_keys("Write a very long story", Keys.SHIFT, Keys.ENTER, Keys.SHIFT,
                       "about a dragon who learns to cook.")
        out["typed"] = driver.execute_script("return document.getElementById('input').value")
        out["users_before_enter"] = len(driver.find_elements(By.CSS_SELECTOR, ".msg.user"))
        box_.send_keys(Keys.ENTER)
        wait(driver, lambda d: len((last_answer(d) or {}).get("text", "")) > 20)
        t0 = time.monotonic()
        wait(driver, lambda d: "1 running" in d.find_element(By.ID, "load-text").text, timeout=5, every=0.02)
        out["running_seen_s"] = time.monotonic() - t0
        out["running_text"] = driver.find_element(By.ID, "load-text").text
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        out["stopped"] = wait(driver, _answer_done, timeout=10)
        t0 = time.monotonic()
        wait(driver, lambda d: "idle" in d.find_element(By.ID, "load-text").text, timeout=5, every=0.02)
        out["idle_seen_s"] = time.monotonic() - t0
        out["idle_text"] = driver.find_element(By.ID, "load-text").text
        out["user_msgs"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.user")]

        # conversations in the side panel: new, switch, delete, kept over a reload
        _set(driver, maxTokens=16)
        driver.refresh()
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        driver.find_element(By.ID, "new-chat").click()
        out["after_new"] = {"msgs": len(driver.find_elements(By.CSS_SELECTOR, ".msg")),
                            "empty": bool(driver.find_elements(By.ID, "empty")), "list": _convs(driver)}
        driver.find_element(By.ID, "input").send_keys("What is the capital of France?", Keys.ENTER)
        wait(driver, _answer_done)
        out["two"] = _convs(driver)
        driver.find_elements(By.CSS_SELECTOR, "#conversations .conv .open")[1].click()   # back to the first
        out["switched"] = [e.text[:40] for e in driver.find_elements(By.CSS_SELECTOR, ".msg.user")]
        delete = driver.find_elements(By.CSS_SELECTOR, "#conversations .conv .delete")[0]  # the France one
        delete.click()
        out["after_one_click"] = _convs(driver)
        delete.click()
        out["after_delete"] = _convs(driver)
        driver.refresh()
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.user"))
        out["after_reload"] = {"list": _convs(driver),
                               "users": [e.text[:40] for e in driver.find_elements(By.CSS_SELECTOR, ".msg.user")]}
        out["kept"] = driver.execute_script("return localStorage.getItem('edgepaged.conversations')")

        # what the model writes is shown, never run: its HTML is text, no script, no handler, no javascript: link
        _set(driver, conversations=[{"id": "x", "title": "hostile", "updated": 1, "messages": [
            {"role": "user", "content": "<b>hi</b>"}, {"role": "assistant", "content": HOSTILE}]}], current="x")
        driver.refresh()
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        time.sleep(0.5)
        out["hostile"] = driver.execute_script("""
            const t = document.querySelector('#thread');
            return {pwned: window.pwned === undefined ? null : window.pwned,
                    scripts: t.querySelectorAll('script').length, imgs: t.querySelectorAll('img').length,
                    handlers: [...t.querySelectorAll('*')].filter(e => [...e.attributes].some(
                        a => a.name.startsWith('on'))).length,
                    hrefs: [...t.querySelectorAll('a')].map(a => a.getAttribute('href')),
                    strong: t.querySelectorAll('strong').length, text: t.textContent,
                    user_b: t.querySelectorAll('.msg.user b').length};""")
        out["resources"] = driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        out["console"] = [e["message"] for e in driver.get_log("browser")]
    finally:
        driver.quit()
    return out


def phone_markdown_scenario(base: str, chromium: str, driver_path: str, shots: Path, kept: str) -> dict:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    out = {}
    driver = open_phone_browser(chromium, driver_path)
    try:
        driver.get(base + "/")
        driver.execute_script("localStorage.setItem('edgepaged.conversations', arguments[0])", kept)
        driver.refresh()
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant pre button.copy"))
        wait(driver, lambda d: d.find_element(By.ID, "box-name").text)
        time.sleep(1.2)
        out["panel_hidden"] = not driver.find_element(By.ID, "panel").is_displayed()
        out["overflow_x"] = driver.execute_script("return document.documentElement.scrollWidth > window.innerWidth")
        driver.execute_script("document.querySelector('#messages').scrollTop = 0")
        driver.save_screenshot(str(shots / "page-phone.png"))
        driver.find_element(By.ID, "panel-button").click()
        out["panel_opened"] = driver.find_element(By.ID, "panel").is_displayed()
        ActionChains(driver).send_keys(Keys.ESCAPE).perform()
        time.sleep(0.2)
        out["panel_closed"] = not driver.find_element(By.ID, "panel").is_displayed()
    finally:
        driver.quit()
    return out


async def test_the_page_markdown_conversations_and_keys(embedded_runner, tmp_path):
    """Issue 26's page: Markdown rendered safely by libraries the box serves itself, code blocks with
    a copy button, a readable line length, the model's and the box's names in the header, a status line
    current within a second and 'idle' when idle, conversations in a side panel, Enter / Shift+Enter /
    Escape; screenshots at desktop and phone width in the test's temporary directory."""
    import httpx
    chromium, driver_path, problem = browser_problem()
    if problem:
        pytest.skip(problem)
    async with serving(embedded_runner) as http:
        base = f"http://127.0.0.1:{http.port}"
        async with httpx.AsyncClient() as c:
            page = await c.get(base + "/")
            lib = await c.get(base + "/static/marked.min.js")
            other = await c.get(base + "/static/chat.html")
            stats = (await c.get(base + "/stats")).json()
        with trio.fail_after(240):
            out = await trio.to_thread.run_sync(desktop_scenario, base, chromium, driver_path, tmp_path)
            phone = await trio.to_thread.run_sync(phone_markdown_scenario, base, chromium, driver_path, tmp_path,
                                                  out["kept"])
        engine_stats = http.engine.stats()
    print(f"screenshots: {tmp_path / 'page-desktop.png'} {tmp_path / 'page-phone.png'}")
    print(json.dumps({k: v for k, v in out.items() if k not in ("console", "kept")}, indent=1)[:4000])
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert lib.status_code == 200 and lib.headers["content-type"].startswith("text/javascript")
    assert lib.headers["x-content-type-options"] == "nosniff" and b"marked" in lib.content[:200]
    assert other.status_code == 404                       # only the two libraries are served there
    assert stats["box"] and stats["model"]

    assert out["viewport"][0] == 1280 and out["panel_shown"]
    assert out["header"] == {"model-name": stats["model"], "box-name": stats["box"]}
    r = out["rendered"]
    assert r["pre"] and "print(" in r["code"] and r["lang"] == "language-python" and r["copy"], r
    assert r["inline"] >= 1 and not r["fence_left"], r
    assert out["copy_label"] == "Copied"
    assert out["clipboard"] == r["code"], out["clipboard"]
    w = out["widths"]
    assert w["thread"] <= 740 and w["answer"] <= 740 and w["left"] > w["panel"] + 100 and w["right"] > 100, w

    assert out["typed"] == "Write a very long story\nabout a dragon who learns to cook."
    assert out["users_before_enter"] == 1                 # Shift+Enter sent nothing
    assert out["running_seen_s"] < 1.5 and "1 running" in out["running_text"] and "tok/s" in out["running_text"]
    assert out["stopped"]["done"] == "stopped"            # Escape stopped it
    assert out["idle_seen_s"] < 1.5 and "0 running" in out["idle_text"] and "tok/s" not in out["idle_text"]
    assert out["user_msgs"][1] == "Write a very long story\nabout a dragon who learns to cook."
    assert engine_stats["finished"].get("cancelled", 0) >= 1 and engine_stats["kv_blocks_used"] == 0

    assert out["after_new"] == {"msgs": 0, "empty": True, "list": [CODE_QUESTION]}
    assert out["two"] == ["What is the capital of France?", CODE_QUESTION]
    assert out["switched"] == [CODE_QUESTION, "Write a very long story\nabout a dragon w"]
    assert out["after_one_click"] == out["two"]          # one click only arms the delete
    assert out["after_delete"] == [CODE_QUESTION]
    assert out["after_reload"] == {"list": [CODE_QUESTION], "users": out["switched"]}

    h = out["hostile"]
    assert h["pwned"] is None and h["scripts"] == 0 and h["imgs"] == 0 and h["handlers"] == 0, h
    assert not [x for x in h["hrefs"] if x and x.strip().lower().startswith("javascript")], h
    assert h["strong"] == 1 and "<img src=x" in h["text"] and "<script>window.pwned=5</script>" in h["text"]
    assert h["user_b"] == 0 and "<b>hi</b>" in h["text"]
    assert all(x.startswith(base + "/") for x in out["resources"]), out["resources"]
    assert not [m for m in out["console"] if "Content Security Policy" in m or "SEVERE" in m], out["console"]

    assert phone["panel_hidden"] and phone["panel_opened"] and phone["panel_closed"], phone
    assert not phone["overflow_x"]
    for name in ("page-desktop.png", "page-phone.png"):
        assert (tmp_path / name).stat().st_size > 10_000


@contextmanager
def desktop_page(base: str, chromium: str, driver_path: str, **settings):
    """The page in a desktop-sized browser with `settings` stored (greedy, short answers)."""
    driver = open_phone_browser(chromium, driver_path, phone=False)
    try:
        driver.get(base + "/")
        _set(driver, **settings)
        driver.refresh()
        yield driver
    finally:
        driver.quit()


def truncation_scenario(base: str, chromium: str, driver_path: str) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    old = []
    for i in range(8):
        old += [{"role": "user", "content": f"Question {i} about the garden, the kitchen and the weather."},
                {"role": "assistant", "content": f"Answer {i}: the garden is green, the kitchen warm, it rains."}]
    with desktop_page(base, chromium, driver_path, temperature=0, maxTokens=12,
                      conversations=[{"id": "long", "title": "long", "updated": 1, "messages": old}],
                      current="long") as driver:
        wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 16)
        out = {}
        for k in range(2):
            driver.find_element(By.ID, "input").send_keys(f"One more question, number {k}?", Keys.ENTER)
            wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]")) == k + 1)
            out[f"notices_{k}"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".notice")]
        out["errors"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".meta.error")]
        return out


async def test_the_page_says_once_that_old_messages_were_left_out(embedded_runner):
    chromium, driver_path, problem = browser_problem()
    if problem:
        pytest.skip(problem)
    async with box.serving(embedded_runner, http=True, max_prompt_tokens=200) as server:
        with trio.fail_after(120):
            out = await trio.to_thread.run_sync(truncation_scenario, server.http_base, chromium, driver_path)
    assert out["errors"] == [], out
    assert len(out["notices_0"]) == 1 and "oldest" in out["notices_0"][0], out
    assert out["notices_1"] == out["notices_0"], out               # said once


def model_picker_scenario(base: str, chromium: str, driver_path: str) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    with desktop_page(base, chromium, driver_path, temperature=0, maxTokens=6) as driver:
        wait(driver, lambda d: d.find_element(By.ID, "box-name").text)
        driver.find_element(By.ID, "settings-button").click()
        out = {"shown": driver.find_element(By.ID, "model-select").is_displayed(),
               "options": [o.text for o in Select(driver.find_element(By.ID, "model-select")).options]}
        Select(driver.find_element(By.ID, "model-select")).select_by_visible_text("kitchen")
        driver.find_element(By.ID, "settings-button").click()
        time.sleep(1.2)
        out["header"] = driver.find_element(By.ID, "model-name").text
        driver.find_element(By.ID, "input").send_keys("Hello?", Keys.ENTER)
        wait(driver, _answer_done)
        driver.refresh()                                     # the choice is kept
        wait(driver, lambda d: d.find_element(By.ID, "model-name").text)
        time.sleep(1.2)
        out["after_reload"] = driver.find_element(By.ID, "model-name").text
        return out


async def test_a_box_with_several_models_lets_the_page_pick_one(tmp_path):
    """Two models (the embedded file under two names, loaded on demand): the page lists them in ⚙,
    the one picked answers (it is the one the box loads), the choice survives a reload."""
    from edgepaged.model import ModelRunner
    from edgepaged.model.loader import default_model_path
    from edgepaged.box.models import ModelSet, ModelSpec, MultiFront
    from edgepaged.server.httpd import HttpConfig, HttpServer
    chromium, driver_path, problem = browser_problem()
    if problem:
        pytest.skip(problem)
    path = default_model_path()
    specs = [ModelSpec(n, str(path), path.stat().st_size, 8192, "llama", "Q4_1") for n in ("house", "kitchen")]
    models = ModelSet(specs, lambda spec, kv: ModelRunner(spec.path, num_blocks=128), budget_bytes=8 << 30,
                      kv_bytes=64 << 20)
    async with trio.open_nursery() as nursery:
        await nursery.start(models.run)
        http = HttpServer(MultiFront(models), HttpConfig(host="127.0.0.1", port=0))
        await nursery.start(http.serve)
        with trio.fail_after(120):
            out = await trio.to_thread.run_sync(model_picker_scenario, f"http://127.0.0.1:{http.port}", chromium,
                                                driver_path)
        loaded = {m["name"]: m["loads"] for m in models.listing() if m["loaded"]}
        http.stop_accepting()
        await models.drain(1)
        nursery.cancel_scope.cancel()
    assert out["shown"] and out["options"] == ["house", "kitchen"], out
    assert out["header"] == "kitchen" and out["after_reload"] == "kitchen", out
    assert loaded == {"kitchen": 1}, loaded                  # the default was never needed


def thinking_scenario(base: str, chromium: str, driver_path: str) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    with desktop_page(base, chromium, driver_path, temperature=0, maxTokens=6) as driver:
        driver.find_element(By.ID, "input").send_keys("Hi there", Keys.ENTER)
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"))
        return driver.execute_script("""
            const m = document.querySelector('.msg.assistant');
            const t = m.querySelector('details.thinking');
            return {thought: t ? t.querySelector('.thought').textContent : null, open: t ? t.open : null,
                    html: t ? t.querySelector('.thought').innerHTML : null,
                    text: m.querySelector('.text').textContent};""")


async def test_the_page_folds_a_thinking_models_thinking(tmp_path):
    """A thinking model's thinking (reasoning_content, which the page asks for) shows folded
    above the answer, as text (its <think> markers are never HTML), and not in the answer."""
    chromium, driver_path, problem = browser_problem()
    if problem:
        pytest.skip(problem)
    from edgepaged.model import ModelRunner
    from edgepaged.testing.families import make_thinker
    runner = ModelRunner(make_thinker(tmp_path / "t", tmp_path / "thinker.gguf"), num_blocks=64)
    async with serving(runner) as http:
        with trio.fail_after(120):
            out = await trio.to_thread.run_sync(thinking_scenario, http.base, chromium, driver_path)
    assert out["thought"] == "<think>" * 5 and out["open"] is False, out
    assert "&lt;think&gt;" in out["html"] and "<think>" not in out["text"], out


def photo_scenario(base: str, chromium: str, driver_path: str, photo: Path) -> dict:
    """On the phone: attach a photo (the 📷 button's file picker: the camera or the gallery),
    ask about it, then ask again in the same conversation."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    out = {}
    driver = open_phone_browser(chromium, driver_path)
    try:
        driver.get(base + "/")
        _set(driver, temperature=0, maxTokens=6)
        driver.refresh()
        wait(driver, lambda d: "running" in d.find_element(By.ID, "load-text").text)
        picker = driver.find_element(By.ID, "photo")
        driver.execute_script("arguments[0].hidden = false", picker)     # (what the button opens)
        picker.send_keys(str(photo))
        wait(driver, lambda d: d.find_element(By.ID, "attach").get_attribute("class") == "on")
        driver.find_element(By.ID, "input").send_keys("What is in this photo?", Keys.ENTER)
        out["first"] = wait(driver, lambda d: (a := last_answer(d)) and a["done"] and a)
        out["attach_after"] = driver.find_element(By.ID, "attach").get_attribute("class")
        wait(driver, lambda d: d.find_element(By.ID, "send").text == "Send")
        driver.find_element(By.ID, "input").send_keys("And the colours?", Keys.ENTER)
        wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and last_answer(d)["done"])
        out["second"] = last_answer(driver)
        out["bubbles"] = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.user")]
        out["stored"] = driver.execute_script("return JSON.parse(localStorage.getItem('edgepaged.conversations'))"
                                              "[0].messages[0].content")
        out["console"] = [e["message"] for e in driver.get_log("browser")]
    finally:
        driver.quit()
    return out


async def test_the_phone_page_sends_a_photo(tmp_path):
    """A vision model served: the page's photo button attaches a picture (sent as an
    image_url, scaled to 1536 pixels at most), the answer comes, the photo stays in the
    conversation (the second turn sends it again and the box finds it: no new encoding)."""
    chromium, driver_path, why = browser_problem()
    if why:
        pytest.skip(why)
    import numpy as np
    from PIL import Image

    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.vision_models import make_smolvlm
    _, model, mmproj = make_smolvlm(tmp_path / "repo")
    runner = CpuRunner(model, num_blocks=256)
    runner.attach_vision(mmproj)
    photo = tmp_path / "kitchen.jpg"
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (1500, 2000, 3), dtype=np.uint8)).save(photo, "JPEG")
    async with serving(runner) as http:
        out = await trio.to_thread.run_sync(photo_scenario, http.base, chromium, driver_path, photo)
    assert out["first"]["done"] == "1" and out["second"]["done"] == "1", out
    assert out["attach_after"] == "" and out["bubbles"][0].startswith("📷 What is in this photo?")
    parts = out["stored"]
    assert parts[0] == {"type": "text", "text": "What is in this photo?"}
    assert parts[1]["image_url"]["url"].startswith("data:image/jpeg;base64,")
    assert runner.images.stats()["images_encoded"] == 1 and runner.images.stats()["images_reused"] >= 1
    assert not [m for m in out["console"] if "SEVERE" in m], out["console"]
