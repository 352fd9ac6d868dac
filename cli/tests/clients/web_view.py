"""The web view in a real browser: Debian's Chromium, driven by Selenium.

Run by cli/tests/up.rs against what `shardplane up` started. Loads the view,
finds every node, deployment and stage in the page, sends chats through the
gateway and sees tokens/s and the time to first token appear, takes a
screenshot, kills an agent and sees its node turn NotReady on the open page.
Exits non-zero on the first failure.

Environment: VIEW (the page's URL), GATEWAY (the OpenAI base URL), API_KEY,
NODES and DEPLOYMENTS (comma-separated, as the page names them), STAGES (how
many stages in all), KILL_PID and KILL_NODE (the agent to kill and its node),
SCREENSHOTS (a directory for the pictures).
"""
import json
import os
import signal
import sys
import time

import openai
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

VIEW = os.environ["VIEW"]
NODES = os.environ["NODES"].split(",")
DEPLOYMENTS = os.environ["DEPLOYMENTS"].split(",")
STAGES = int(os.environ["STAGES"])
SHOTS = os.environ["SCREENSHOTS"]


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}", flush=True)


def wait_for(what, within, probe):
    """probe() until it returns something truthy; fails after `within` s."""
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except Exception as e:  # the page may be redrawing
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.25)
    check(False, f"{what} (within {within} s; last: {last!r})")


options = webdriver.ChromeOptions()
options.binary_location = "/usr/bin/chromium"
for arg in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--window-size=1400,1300"]:
    options.add_argument(arg)
options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
try:
    driver.get(VIEW)
    css = driver.find_elements

    def attr(selector, name):
        found = css(By.CSS_SELECTOR, selector)
        return found[0].get_attribute(name) if found else None

    # Every node, in the topology and in the table; every deployment, Ready.
    for n in NODES:
        wait_for(f"node {n} in the topology", 20, lambda: css(By.CSS_SELECTOR, f'g.node[data-node="{n}"]'))
        check(attr(f'tr[data-node-row="{n}"]', "data-ready") == "Ready", f"{n} is Ready in the table")
    for d in DEPLOYMENTS:
        card = f'div[data-deployment="{d}"]'
        wait_for(f"deployment {d} on the page", 20, lambda: css(By.CSS_SELECTOR, card))
        check(attr(card, "data-ready-replicas") == attr(card, "data-replicas"), f"{d} has every replica ready")
        check(css(By.CSS_SELECTOR, f'{card} [data-condition="Ready"][data-status="True"]'),
              f"{d} shows its Ready condition")
    stages = css(By.CSS_SELECTOR, "#topology g.stage")
    check(len(stages) == STAGES, f"{STAGES} stages drawn on their nodes (saw {len(stages)})")
    check(css(By.CSS_SELECTOR, "#topology polyline.path"), "a pipeline is drawn as a path")
    check(len(css(By.CSS_SELECTOR, "#legend li")) >= len(DEPLOYMENTS), "a legend line per instance")

    # Traffic: chats through the gateway show up as tokens/s and TTFT.
    client = openai.OpenAI(base_url=os.environ["GATEWAY"], api_key=os.environ["API_KEY"], max_retries=0)
    served = {}
    for d in DEPLOYMENTS:
        name = d.split("/", 1)[1]
        model = {"smollm2-daily": "smollm2"}.get(name, name)
        for _ in range(3):
            r = client.chat.completions.create(
                model=model, max_tokens=16, temperature=0,
                messages=[{"role": "user", "content": "Name three colours."}])
            served[name] = served.get(name, 0) + r.usage.completion_tokens

    def traffic_shown():
        shown = {}
        for d in DEPLOYMENTS:
            name = d.split("/", 1)[1]
            t = css(By.CSS_SELECTOR, f'[data-traffic="{name}"]')
            rate = t[0].get_attribute("data-tokens-per-second") if t else ""
            if not rate or float(rate) <= 0 or "TTFT p50" not in t[0].text:
                return None
            shown[name] = (float(rate), t[0].text)
        return shown

    shown = wait_for("tokens/s and TTFT of every deployment", 30, traffic_shown)
    for name, (rate, text) in shown.items():
        print(f"   {name}: {text!r} ({served[name]} tokens sent)")
    path = os.path.join(SHOTS, "web-view.png")
    check(driver.save_screenshot(path), f"screenshot {path}")

    # Kill an agent: its node turns NotReady on the open page, by itself.
    victim = os.environ["KILL_NODE"]
    os.kill(int(os.environ["KILL_PID"]), signal.SIGKILL)
    killed = time.monotonic()
    wait_for(f"{victim} NotReady on the page", 60,
             lambda: (attr(f'g.node[data-node="{victim}"]', "data-ready") or "").startswith("NotReady"))
    print(f"   {victim} NotReady on the page {time.monotonic() - killed:.1f} s after the kill")
    check(attr(f'tr[data-node-row="{victim}"]', "data-ready").startswith("NotReady"), "the table agrees")
    check("notready" in attr(f'g.node[data-node="{victim}"]', "class"), "the node's box is marked")
    path = os.path.join(SHOTS, "web-view-node-lost.png")
    check(driver.save_screenshot(path), f"screenshot {path}")

    # The page ran without a script error or a refused resource.
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    check(not errors, f"no errors in the browser's console {json.dumps(errors)[:500]}")
finally:
    driver.quit()
