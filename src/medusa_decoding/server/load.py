"""`medusa load-test`: the load and fault test of running servers. Many concurrent clients for a
while, mixed streaming and non-streaming, chat and completions, speculative and plain
(`"speculative": false`) requests, on one or more servers (one method each); some clients drop
their stream mid-way, some send malformed requests. Every greedy answer is checked against the
same request sent alone before the load; at the end every slot must be free. Resident memory
comes from /health. tests/test_load.py runs a short version on tiny models.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time

import httpx
import openai

from ..config import LoadConfig, MedusaError

PROMPTS = ["Hello there", "def fibonacci(n):", "The quick brown fox", "List three colours.",
           "Medusa heads guess ahead", "1 2 3 4 5", "Write a haiku about rain.", "Why is the sky blue?"]


def malformed(model: str) -> list[tuple[str, bytes | dict]]:
    """(path, body) pairs that must each get a 4xx with an OpenAI error body."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    return [
        (chat, b"{not json"), (comp, b"[1, 2"), (chat, []), (chat, {"model": model}),
        (chat, {"model": model, "messages": "hi"}),
        (chat, {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
        (chat, {"model": model, "messages": []}), (comp, {"model": model, "prompt": "x", "max_tokens": -3}),
        (comp, {"model": model, "prompt": "x", "temperature": 7}), (comp, {"model": "no-such-model", "prompt": "x"}),
        (comp, {"model": model, "prompt": "   "}), (comp, {"model": model, "prompt": "x", "n": 3}),
        (comp, {"model": model, "prompt": "x", "max_tokens": 10 ** 9}), (comp, {"model": model, "prompt": [10 ** 9]}),
        (chat, {"model": model, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ]


class Tally:
    """What the clients saw, counted."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.status: dict[str, int] = {}
        self.latency: list[float] = []
        self.problems: list[str] = []
        self.tokens = 0

    def add(self, what: str, status: int | str | None = None) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        if status is not None:
            self.status[str(status)] = self.status.get(str(status), 0) + 1

    def problem(self, text: str) -> None:
        self.add("problem")
        if len(self.problems) < 20:
            self.problems.append(text)


async def answer(client: openai.AsyncOpenAI, model: str, kind: str, prompt: str, speculative: bool,
                 max_tokens: int, stream: bool) -> tuple[str, int]:
    """One greedy request through the openai client -> (text, completion tokens)."""
    extra = {"speculative": speculative}
    if kind == "chat":
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
                  extra_body=extra)
        if stream:
            out = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
            text, usage = "", 0
            async for c in out:
                if c.choices and c.choices[0].delta.content:
                    text += c.choices[0].delta.content
                if c.usage:
                    usage = c.usage.completion_tokens
            return text, usage
        out = await client.chat.completions.create(**kw)
        return out.choices[0].message.content, out.usage.completion_tokens
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra)
    if stream:
        out = await client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        text, usage = "", 0
        async for c in out:
            if c.choices:
                text += c.choices[0].text
            if c.usage:
                usage = c.usage.completion_tokens
        return text, usage
    out = await client.completions.create(**kw)
    return out.choices[0].text, out.usage.completion_tokens


async def health(url: str) -> dict:
    """The server's /health: its model, active and queued requests, resident memory."""
    async with httpx.AsyncClient(timeout=10) as h:
        return (await h.get(f"{url}/health")).json()


async def run_load(urls: list[str], cfg: LoadConfig = LoadConfig()) -> dict:
    """Drive the servers at `urls` -> a report (counts, statuses, latencies, memory, problems)."""
    rng = random.Random(cfg.seed)
    names = {url: (await health(url))["model"] for url in urls}
    limits = httpx.Limits(max_connections=None)
    openai_clients = {url: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=cfg.timeout_s,
                                              http_client=httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s))
                      for url in urls}
    start_memory = {url: (await health(url)).get("rss_mib") for url in urls}
    cases = [(url, kind, p, spec) for url in urls for kind in ("chat", "completion") for p in PROMPTS
             for spec in (True, False)]
    solo = {}
    for case in cases:  # each request alone first: what every answer under load must equal
        url, kind, p, spec = case
        solo[case] = (await answer(openai_clients[url], names[url], kind, p, spec, cfg.max_tokens, False))[0]
    tally = Tally()
    deadline = time.monotonic() + cfg.duration_s

    async def drop_stream(h: httpx.AsyncClient, url: str) -> None:
        body = {"model": names[url], "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": 200, "temperature": 0, "stream": True}
        async with h.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break  # leave mid-stream
        tally.add("disconnected", r.status_code)

    async def send_malformed(h: httpx.AsyncClient, url: str) -> None:
        path, body = rng.choice(malformed(names[url]))
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = await h.post(f"{url}{path}", headers={"Content-Type": "application/json"}, **kw)
        tally.add("malformed", r.status_code)
        error = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        if not 400 <= r.status_code < 500 or not isinstance(error, dict) or "message" not in error:
            tally.problem(f"malformed {body!r} to {path}: {r.status_code} {r.text[:120]}")

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=cfg.timeout_s) as h:
            while time.monotonic() < deadline:
                url, roll = rng.choice(urls), rng.random()
                t0 = time.monotonic()
                try:
                    if roll < cfg.disconnect:
                        await drop_stream(h, url)
                    elif roll < cfg.disconnect + cfg.bad:
                        await send_malformed(h, url)
                    else:
                        case = rng.choice([c for c in cases if c[0] == url])
                        _, kind, p, spec = case
                        text, n = await answer(openai_clients[url], names[url], kind, p, spec, cfg.max_tokens,
                                               rng.random() < 0.5)
                        tally.latency.append(time.monotonic() - t0)
                        tally.tokens += n
                        if text != solo[case]:
                            tally.problem(f"answer differs from alone: {case}: {text!r} vs {solo[case]!r}")
                        tally.add("answered", 200)
                except openai.APIStatusError as e:
                    tally.add("error", e.status_code)
                    tally.problem(f"client {i}: HTTP {e.status_code}: {str(e)[:160]}")
                except Exception as e:  # a connection or protocol failure: the server misbehaved
                    tally.add("error", type(e).__name__)
                    tally.problem(f"client {i}: {type(e).__name__}: {str(e)[:160]}")

    t0 = time.monotonic()
    await asyncio.gather(*(client_loop(i) for i in range(cfg.clients)))
    elapsed = time.monotonic() - t0
    busy = await wait_idle(urls, tally)
    end_memory = {url: (await health(url)).get("rss_mib") for url in urls}
    for c in openai_clients.values():
        await c.close()
    return report(tally, names, cfg.clients, elapsed, {"start": start_memory, "end": end_memory}, busy)


async def wait_idle(urls: list[str], tally: Tally, wait_s: float = 30.0) -> dict[str, int]:
    """Every slot freed (dropped streams and finished requests alike) -> url: requests still active
    or queued after wait_s (each a problem)."""
    busy = {}
    for url in urls:
        deadline = time.monotonic() + wait_s
        while True:
            h = await health(url)
            if (h["active"] == 0 and h["queued"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        busy[url] = h["active"] + h["queued"]
        if busy[url]:
            tally.problem(f"{url}: {h['active']} active and {h['queued']} queued after the load")
    return busy


def report(tally: Tally, names: dict[str, str], clients: int, elapsed: float, memory: dict, busy: dict) -> dict:
    """The load test's report (JSON-ready); "ok" is false when anything went wrong."""
    lat = sorted(tally.latency)
    return {
        "servers": names, "clients": clients, "duration_s": round(elapsed, 1),
        "requests": sum(tally.counts.get(k, 0) for k in ("answered", "disconnected", "malformed", "error")),
        "counts": tally.counts, "status": tally.status, "tokens": tally.tokens,
        "latency_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                      "p95": round(lat[int(0.95 * (len(lat) - 1))], 3) if lat else None},
        "rss_mib": memory, "busy_at_end": busy, "problems": tally.problems, "ok": not tally.problems,
    }


@contextlib.contextmanager
def started_servers(args: list[str], wait_s: float = 600.0):
    """Start `medusa serve ARGS` on a free loopback port for each of `args` -> their urls; every one
    is stopped on the way out (nothing outlives the test)."""
    procs, urls = [], []
    try:
        for extra in args:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            procs.append(subprocess.Popen([sys.executable, "-m", "medusa_decoding.cli", "serve", "--port", str(port),
                                           *shlex.split(extra)], stdout=subprocess.DEVNULL))  # its access log
            urls.append(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + wait_s
            while True:
                if procs[-1].poll() is not None:
                    raise MedusaError(f"medusa serve {extra} exited with {procs[-1].returncode}")
                try:
                    httpx.get(f"{urls[-1]}/health", timeout=2)
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise MedusaError(f"medusa serve {extra} did not answer /health in {wait_s:.0f} s") from None
                    time.sleep(0.5)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
