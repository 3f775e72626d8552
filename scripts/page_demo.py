"""Drive the page of `medusa serve` in headless Chromium with a few prompts; write a screenshot
and print what the page showed (tokens/s, steps, mean accepted length, tokens by source).

    python scripts/page_demo.py --out docs/page.png            # built-in model, default method
    python scripts/page_demo.py --serve-args "--dtype float32"  # any `medusa serve` options

It starts `medusa serve` itself (a subprocess on a free loopback port) and stops it at the end.
Needs selenium and Debian's chromium + chromium-driver.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday.",
    "Give three tips for keeping houseplants alive.",
]
SIDE_BY_SIDE = "List the planets of the solar system in order from the sun."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, proc: subprocess.Popen, within_s: float = 600) -> dict:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"medusa serve exited with {proc.returncode}")
        try:
            return json.load(urllib.request.urlopen(f"{url}/health", timeout=2))
        except OSError:
            time.sleep(0.5)
    sys.exit("medusa serve did not come up")


def browser():
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options,
                            service=webdriver.ChromeService(executable_path=shutil.which("chromedriver")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/page.png", help="the screenshot")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="extra options for medusa serve")
    args = ap.parse_args()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(["medusa", "serve", "--port", str(port), *shlex.split(args.serve_args)])
    driver = None
    try:
        health = wait_health(url, proc)
        print(f"serving {health['model']}: {health['method']}", flush=True)
        driver = browser()
        driver.get(f"{url}/")
        wait = WebDriverWait(driver, 600)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        box = driver.find_element(By.ID, "max-tokens")
        box.clear()
        box.send_keys(str(args.max_tokens))

        def ask(prompt: str) -> None:
            before = len(driver.find_elements(By.CSS_SELECTOR, ".figures"))
            driver.find_element(By.ID, "prompt").send_keys(prompt)
            driver.find_element(By.ID, "send").click()
            wait.until(lambda d: d.find_element(By.ID, "send").is_enabled()
                       and len(d.find_elements(By.CSS_SELECTOR, ".figures")) > before)

        print("| prompt | tokens | tok/s | steps | mean accepted length | draft | n-gram | base |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for prompt in PROMPTS:
            driver.find_element(By.ID, "clear").click()
            ask(prompt)
            spans = driver.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok")
            sources = [s.get_attribute("data-source") for s in spans]
            figure = {k: driver.find_element(By.ID, f"stat-{k}").text for k in ("tps", "steps", "tau")}
            print(f"| {prompt[:48]}… | {len(spans)} | {figure['tps']} | {figure['steps']} | {figure['tau']} | "
                  f"{sources.count('draft')} | {sources.count('ngram')} | "
                  f"{sources.count('bonus') + sources.count('prefill')} |", flush=True)
        driver.find_element(By.ID, "clear").click()
        driver.find_element(By.ID, "side-by-side").click()
        ask(SIDE_BY_SIDE)
        wait.until(lambda d: d.find_element(By.ID, "verdict").text)
        print(f"side by side ({SIDE_BY_SIDE!r}): {driver.find_element(By.ID, 'verdict').text}")
        driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(args.out)
        print(f"screenshot: {args.out}")
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
