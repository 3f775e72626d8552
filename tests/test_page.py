"""The page on `GET /` and the per-token provenance it draws: the `medusa.tokens` of streamed
chunks against the engine's stats, the page served offline, and the page in a real headless
Chromium (skipped with a reason where none is installed)."""

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from medusa_decoding.config import NgramConfig  # noqa: E402
from medusa_decoding.engine import MedusaModel  # noqa: E402
from medusa_decoding.server import create_app  # noqa: E402
from medusa_decoding.text import TextDecoder  # noqa: E402

from conftest import Server, byte_tokenizer, random_heads, tiny_llama  # noqa: E402

NAME = "tiny"
# repeats, so the n-gram branch finds copies; non-ASCII, so tokens split characters
PROMPT = "one two three, one two three, one two three: déjà vu, ünïcödé"


@pytest.fixture(scope="module")
def model():
    base = tiny_llama()
    return MedusaModel(base, byte_tokenizer(), heads=random_heads(base, scale=3.0), name=NAME,
                       ngram=NgramConfig(length=4))


@pytest.fixture(scope="module")
def server(model):
    s = Server(create_app(model, max_batch_size=4, adaptive=False))
    yield s
    s.stop()


def stream(url, speculative=True, max_tokens=48, prompt=PROMPT):
    """One streamed chat request -> (content, the chunks' tokens, the final chunk's medusa)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "speculative": speculative}
    content, tokens, summary = "", [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                content += chunk["choices"][0]["delta"]["content"]
            medusa = chunk.get("medusa", {})  # not on the first chunk (the role)
            tokens += medusa.get("tokens", [])
            if "steps" in medusa:
                summary = medusa
    return content, tokens, summary


def test_stream_provenance_sums_up_to_the_stats(server, model):
    content, tokens, summary = stream(server.url)
    assert "".join(t["text"] for t in tokens) == content
    assert len(tokens) == len(model.generate(PROMPT, chat=True, max_new_tokens=48).token_ids)
    assert [t["source"] for t in tokens].count("prefill") == 1 and tokens[0]["source"] == "prefill"
    assert max(t["step"] for t in tokens) == summary["steps"]
    # a depth-d token per step that accepted a depth-d candidate: the per-depth acceptance (the
    # stats count what verification accepted: a last step cut at max_tokens counts its drafts past the cut)
    per_step = {}
    for t in tokens[1:]:
        per_step.setdefault(t["step"], []).append(t)
    last = per_step[summary["steps"]]
    cut = last[-1]["source"] != "bonus"
    for d, share in enumerate(summary["acceptance_per_depth"] + [0.0], start=1):
        missing = round(share * summary["steps"]) - sum(t["depth"] == d for t in tokens)
        assert missing in ((0, 1) if cut and d > len(last) else (0,)), d
    ngram = sum(t["source"] == "ngram" for t in tokens)
    assert ngram == summary["accepted_by"].get("ngram", 0) or (cut and last[0]["source"] == "ngram")
    accepted = sum(t["depth"] > 0 for t in tokens)
    assert accepted > 0 and ngram > 0  # both kinds occur, so the sums test something
    for step in per_step.values():  # each step: its drafts at depth 1, 2, ... from one branch, then the bonus
        drafts = step if step is last and cut else step[:-1]
        assert [t["depth"] for t in drafts] == list(range(1, len(drafts) + 1))
        assert len({t["source"] for t in drafts}) <= 1
    assert summary["steps"] == len(per_step)


def test_plain_request_is_all_bonus_and_the_same_text(server):
    spec, spec_tokens, spec_summary = stream(server.url)
    plain, tokens, summary = stream(server.url, speculative=False)
    assert plain == spec  # greedy, fp32: speculation changes nothing
    assert {t["source"] for t in tokens[1:]} == {"bonus"} and summary["method"] == "plain"
    assert summary["steps"] == len(tokens) - 1 and summary["mean_accepted_length"] == 1.0
    assert spec_summary["steps"] < summary["steps"]


def test_pieces_join_up_to_the_text():
    tok = byte_tokenizer()
    text = "a déjà vu STOP never sent"
    ids = tok.encode(text, add_special_tokens=False)
    for stop in ([], ["STOP"]):
        decoder = TextDecoder(tok, stop)
        sent, pieces = "", []
        for i in range(0, len(ids), 3):  # chunks that cut characters in two
            sent += decoder.push(ids[i: i + 3])
            pieces += decoder.pieces()
            assert sent.startswith("".join(p for _, p in pieces))
            if decoder.stopped:
                break
        sent += decoder.flush()
        pieces += decoder.pieces()
        assert "".join(p for _, p in pieces) == sent == (text.split("STOP")[0] if stop else text)
        assert [i for i, _ in pieces] == list(range(len(decoder.token_ids)))


def test_page_is_served_offline(server):
    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "<script>" in page and "/v1/chat/completions" in page
    for external in ("http://", "https://", "//cdn", "src=\"http", "@import"):
        assert external not in page, external  # no CDN, no font, no remote anything: machines are offline
    assert httpx.get(f"{server.url}/health").json()["method"] == server.app.state.scheduler.decoder.method.describe()


def chromium():
    for path in (shutil.which("chromium"), shutil.which("chromium-browser"), shutil.which("google-chrome")):
        if path:
            return path
    return None


@pytest.mark.skipif(chromium() is None or shutil.which("chromedriver") is None,
                    reason="no chromium and chromedriver installed (Debian: apt-get install chromium chromium-driver)")
def test_page_in_headless_chromium(server, model, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = chromium()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1280,900", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    driver = webdriver.Chrome(options=options, service=service)
    try:
        driver.get(f"{server.url}/")
        wait = WebDriverWait(driver, 30)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "true")
        assert driver.find_element(By.ID, "method").text == model.method().describe()
        driver.find_element(By.ID, "max-tokens").clear()
        driver.find_element(By.ID, "max-tokens").send_keys("48")

        driver.find_element(By.ID, "prompt").send_keys(PROMPT)
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "stat-steps").text not in ("", "–"))
        spans = driver.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok")
        content, tokens, summary = stream(server.url)
        assert len(spans) == len(tokens)
        assert [s.get_attribute("data-source") for s in spans] == [t["source"] for t in tokens]
        assert "".join(s.get_attribute("textContent") for s in spans) == content
        assert int(driver.find_element(By.ID, "stat-steps").text) == summary["steps"]
        drafted = [s for s in spans if s.get_attribute("data-source") in ("draft", "ngram")]
        assert drafted and "depth" in drafted[0].get_attribute("title")

        driver.find_element(By.ID, "clear").click()  # a new chat: the tiny model's context is short
        driver.find_element(By.ID, "side-by-side").click()
        driver.find_element(By.ID, "prompt").send_keys("Count: 1 2 3 1 2 3 1 2 3")
        driver.find_element(By.ID, "send").click()
        wait.until(lambda d: d.find_element(By.ID, "verdict").text)
        plain = driver.find_elements(By.CSS_SELECTOR, ".pair .plain .tok")
        spec = driver.find_elements(By.CSS_SELECTOR, ".pair .speculative .tok")
        assert plain and spec and len(plain) == len(spec)
        assert {s.get_attribute("data-source") for s in plain} <= {"prefill", "bonus"}
        assert driver.find_element(By.ID, "verdict").get_attribute("data-identical") == "true"
        shot = Path(os.environ.get("MEDUSA_SCREENSHOT", tmp_path / "page.png"))
        assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        driver.quit()
