"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP on
127.0.0.1 (uvicorn in a background thread, tiny random model, byte tokenizer)."""

import concurrent.futures
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from medusa_decoding.config import NgramConfig  # noqa: E402
from medusa_decoding.engine import MedusaModel  # noqa: E402
from medusa_decoding.server import create_app  # noqa: E402

from conftest import Server, byte_tokenizer, random_heads, tiny_llama  # noqa: E402

try:
    import httpx2 as httpx  # the name openai's client depends on here
except ImportError:
    httpx = pytest.importorskip("httpx")

NAME = "tiny"


@pytest.fixture(scope="module")
def medusa():
    base = tiny_llama()
    return MedusaModel(base, byte_tokenizer(), heads=random_heads(base), name=NAME)


@pytest.fixture(scope="module")
def server(medusa):
    s = Server(create_app(medusa, max_batch_size=8, adaptive=False))  # stats comparable with generate
    yield s
    s.stop()


def slow_steps(monkeypatch, app, delay_s=0.02):
    """Make every decoding step of `app` take at least delay_s; record cancelled ids."""
    decoder = app.state.scheduler.decoder
    step, cancel, cancelled = decoder.step, decoder.cancel, []

    def slow_step():
        time.sleep(delay_s)
        return step()

    def recording_cancel(request_id):
        found = cancel(request_id)
        if found:
            cancelled.append(request_id)
        return found

    monkeypatch.setattr(decoder, "step", slow_step)
    monkeypatch.setattr(decoder, "cancel", recording_cancel)
    return cancelled


def wait_idle(url, within_s):
    deadline = time.monotonic() + within_s
    while True:
        health = httpx.get(f"{url}/health").json()
        if health["active"] == 0 and health["queued"] == 0:
            return health
        assert time.monotonic() < deadline, f"still busy after {within_s} s: {health}"
        time.sleep(0.02)


PROMPTS = ["Hello there", "def f(x):", "The quick brown fox", "a", "Medusa heads guess ahead", "1 2 3 4"]


def test_health_and_models(server):
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["max_batch_size"] == 8
    assert health["dtype"] == "float32" and health["exact"] is False  # which guarantee the answers carry
    assert health["numerics"] == "fp32"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_generate(server, medusa, stream):
    client = server.client()
    for i, prompt in enumerate(PROMPTS):
        n = 5 + 3 * i
        want = medusa.generate(prompt, chat=False, max_new_tokens=n)
        if stream:
            chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            usage = chunks[-1].usage
            medusa_stats = [c.model_extra["medusa"] for c in chunks if "steps" in (c.model_extra.get("medusa") or {})]
            assert finish == [want.finish_reason] and len(medusa_stats) == 1
            assert all(c.object == "text_completion" for c in chunks)
        else:
            out = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0)
            text, usage, medusa_stats = out.choices[0].text, out.usage, [out.model_extra["medusa"]]
            assert out.choices[0].finish_reason == want.finish_reason and out.object == "text_completion"
        assert text == want.text
        assert usage.completion_tokens == len(want.token_ids)
        assert usage.prompt_tokens == medusa.encode(prompt, chat=False).shape[1]
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert medusa_stats[0]["steps"] == want.stats.steps
        assert medusa_stats[0]["mean_accepted_length"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_greedy_equals_generate(server, medusa, stream):
    client = server.client()
    for prompt in PROMPTS[:3]:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
        want = medusa.generate(messages, max_new_tokens=12)
        if stream:
            chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                                         temperature=0, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert all(c.object == "chat.completion.chunk" for c in chunks)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason == want.finish_reason
        else:
            out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
            assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
            assert out.choices[0].finish_reason == want.finish_reason
            assert out.usage.completion_tokens == len(want.token_ids)
            text = out.choices[0].message.content
        assert text == want.text


def test_stop_strings_and_seeded_sampling(server, medusa):
    client = server.client()
    full = medusa.generate("Hello there", chat=False, max_new_tokens=30)
    stop = full.text[10:12]
    want = medusa.generate("Hello there", chat=False, max_new_tokens=30, stop=[stop])
    assert len(want.text) < len(full.text)
    for stream in (False, True):
        out = client.completions.create(model=NAME, prompt="Hello there", max_tokens=30, temperature=0,
                                        stop=[stop, "\x00never"], stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == "stop"
    # seeded sampling is reproducible
    texts = {client.completions.create(model=NAME, prompt="abc", max_tokens=20, temperature=0.9, top_p=0.9,
                                       seed=7).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_32_concurrent_clients_get_their_own_answers(server, medusa):
    jobs = [(f"prompt number {i}: " + "xyz"[i % 3] * (i % 7), 8 + i % 9, i % 2 == 0, i % 4 == 1) for i in range(32)]
    want = []
    for prompt, n, _, chat in jobs:
        p = [{"role": "user", "content": prompt}] if chat else prompt
        want.append(medusa.generate(p, chat=chat, max_new_tokens=n).text)

    def ask(job):
        prompt, n, stream, chat = job
        client = server.client()
        if chat:
            out = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=n, temperature=0, stream=stream)
            return "".join(c.choices[0].delta.content or "" for c in out) if stream else out.choices[0].message.content
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    decoder = server.app.state.scheduler.decoder
    sizes, step = [], decoder.step

    def recording_step():
        sizes.append(len(decoder))
        return step()

    decoder.step = recording_step
    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            got = list(pool.map(ask, jobs))
    finally:
        del decoder.step
    assert got == want
    assert max(sizes) == 8  # the batch filled up; the others waited in the queue
    wait_idle(server.url, 2)


def error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert body["error"]["param"] == param
    if code:
        assert body["error"]["code"] == code
    return body["error"]


def test_bad_requests_get_openai_errors(server):
    url = f"{server.url}/v1"
    post = lambda path, body: httpx.post(f"{url}/{path}", json=body)  # noqa: E731
    ok = {"model": NAME, "prompt": "hi", "max_tokens": 3}
    r = httpx.post(f"{url}/completions", content=b'{"model": "tiny", "prompt": ', headers={"content-type": "application/json"})
    error(r, 400, code="invalid_json")
    error(post("completions", {"model": NAME}), 400, "prompt")
    error(post("completions", {**ok, "max_tokens": "many"}), 400, "max_tokens")
    error(post("completions", {**ok, "model": "gpt-9"}), 404, "model", "model_not_found")
    error(post("completions", {**ok, "max_tokens": 0}), 400, "max_tokens")
    error(post("completions", {**ok, "max_tokens": 10_000}), 400, "max_tokens", "context_length_exceeded")
    error(post("completions", {**ok, "prompt": "x" * 300}), 400, "prompt", "context_length_exceeded")
    error(post("completions", {**ok, "prompt": ""}), 400, "prompt")
    error(post("completions", {**ok, "n": 2}), 400, "n")
    error(post("completions", {**ok, "temperature": 5}), 400, "temperature")
    error(post("completions", {**ok, "top_p": 0}), 400, "top_p")
    error(post("completions", {**ok, "stop": ""}), 400, "stop")
    error(post("chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "hi"}]}),
          400, "messages.0.role")
    error(post("chat/completions", {"model": NAME, "messages": "hi"}), 400, "messages")
    error(post("chat/completions", {"model": NAME, "messages": []}), 400, "messages")
    error(httpx.get(f"{url}/nothing-here"), 404)
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    # the server keeps serving
    assert post("completions", ok).status_code == 200
    assert client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0).choices[0].text is not None


def test_dropped_stream_frees_its_slot_and_spares_the_others(server, medusa, monkeypatch):
    cancelled = slow_steps(monkeypatch, server.app)  # 200 tokens would now take > 4 s
    body = {"model": NAME, "prompt": "a long story", "max_tokens": 200, "temperature": 0, "stream": True}
    want = medusa.generate("keep going", chat=False, max_new_tokens=15).text
    other = {}

    def other_client():
        other["text"] = server.client().completions.create(model=NAME, prompt="keep going", max_tokens=15,
                                                           temperature=0).choices[0].text

    thread = threading.Thread(target=other_client)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        thread.start()
        lines = response.iter_lines()
        events = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert events and "[DONE]" not in events[-1]
        json.loads(events[0][len("data: "):])
    dropped = time.monotonic()
    wait_idle(server.url, 3)
    thread.join(10)
    assert time.monotonic() - dropped < 3.5  # far less than the 200 tokens would take
    assert len(cancelled) == 1
    assert other["text"] == want
    # a non-streaming client that gives up is cancelled as well
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.5)
    wait_idle(server.url, 3)
    assert len(cancelled) == 2


def test_shutdown_cancels_in_flight_requests(medusa, monkeypatch):
    app = create_app(medusa, max_batch_size=2)
    s = Server(app, graceful_timeout_s=5)
    slow_steps(monkeypatch, app, delay_s=0.05)
    body = {"model": NAME, "prompt": "go on", "max_tokens": 200, "temperature": 0}
    results = []

    def request(stream):
        try:
            with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": stream}, timeout=20) as r:
                results.append((r.status_code, b"".join(r.iter_bytes())))
        except httpx.HTTPError as e:  # the connection closes mid-response
            results.append((None, repr(e).encode()))

    threads = [threading.Thread(target=request, args=(stream,)) for stream in (True, False, False)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert httpx.get(f"{s.url}/health").json()["active"] == 2
    start = time.monotonic()
    s.stop()
    for t in threads:
        t.join(10)
    assert time.monotonic() - start < 3  # not the 5 s graceful timeout: every request ended at once
    results.sort(key=lambda r: r[1][:1])
    assert [status for status, _ in results] == [200, 503, 503]  # the stream, then the two others
    stream = results[0][1].decode()
    assert "shutting_down" in stream.split("data: ")[-1] and "[DONE]" not in stream
    for _, out in results[1:]:
        assert json.loads(out)["error"]["code"] == "shutting_down"
    scheduler = app.state.scheduler
    assert len(scheduler.decoder) == 0 and not scheduler.jobs and scheduler.queue.empty()


def test_cli_serve(tmp_path_factory, capsys, monkeypatch):
    """`medusa serve` loads the model and hands it to server.serve; bad options exit 2 with one line."""
    import sys

    from medusa_decoding import cli, server as server_module

    from conftest import save_tiny

    folder, heads = save_tiny(tmp_path_factory, max_positions=64)
    calls = []
    monkeypatch.setattr(server_module, "serve", lambda model, **kw: calls.append((model, kw)))

    def medusa(*args):
        monkeypatch.setattr(sys, "argv", ["medusa", "serve", *map(str, args)])
        with pytest.raises(SystemExit) as exit_:
            cli.main()
        return exit_.value.code, capsys.readouterr().err

    code, _ = medusa("--model", folder, "--heads", heads, "--port", 8123, "--max-batch-size", 4,
                     "--tree", "dynamic", "--fixed-budget", "--dtype", "float32", "--device", "cpu")
    assert code == 0 and len(calls) == 1
    model, kw = calls[0]
    assert model.heads is not None and model.tree.budget == 16 and model.ngram == NgramConfig()
    assert kw == {"host": "127.0.0.1", "port": 8123, "max_batch_size": 4, "use_medusa": True, "adaptive": False}
    for args in (["--max-batch-size", 0], ["--port", 0], ["--ngram", -1], ["--port", "x"]):
        code, err = medusa("--model", folder, *args)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert len(calls) == 1


def methods_for(base, tok):
    """Every method the CLI runs, on random drafters (fp32): name -> MedusaModel."""
    import torch

    from medusa_decoding import drafters
    from medusa_decoding.config import NgramConfig

    out = {"plain": MedusaModel(base, tok, name=NAME), "medusa+ngram": MedusaModel(base, tok, heads=random_heads(base), ngram=NgramConfig(length=4), name=NAME),
           "dynamic": MedusaModel(base, tok, heads=random_heads(base), tree="dynamic", tree_budget=8, name=NAME),
           "ngram": MedusaModel(base, tok, ngram=NgramConfig(length=4), name=NAME)}
    for kind in ("hydra", "eagle"):
        d = drafters.for_base(kind, base, shortlist_size=256)
        with torch.no_grad():
            for p in d.parameters():
                p.normal_(0, 0.05)
        out[f"{kind}+ngram"] = MedusaModel(base, tok, heads=d, ngram=NgramConfig(length=4), name=NAME, tree_budget=6)
    return out


def test_every_method_is_served_and_answers_as_alone():
    """Each method (random drafters, adaptive budgets): 8 concurrent clients, streaming and not,
    chat and completions; every greedy answer equals the same request decoded alone (fp32)."""
    from concurrent.futures import ThreadPoolExecutor

    base, tok = tiny_llama(), byte_tokenizer()
    for name, model in methods_for(base, tok).items():
        server = Server(create_app(model, max_batch_size=4))
        try:
            client = server.client()

            def request(i):
                prompt, n = PROMPTS[i % len(PROMPTS)] + str(i), 6 + 2 * i
                return (prompt if i % 2 else [{"role": "user", "content": prompt}]), n

            wants = []
            for i in range(8):  # alone, before the server is asked anything
                prompt, n = request(i)
                wants.append(model.generate(prompt, chat=not i % 2, max_new_tokens=n).text)

            def ask(i):
                prompt, n = request(i)
                if i % 2:
                    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0,
                                                    stream=i % 4 == 1)
                    return "".join(c.choices[0].text for c in out) if i % 4 == 1 else out.choices[0].text
                out = client.chat.completions.create(model=NAME, messages=prompt, max_tokens=n, temperature=0)
                return out.choices[0].message.content

            with ThreadPoolExecutor(8) as pool:
                results = list(zip(pool.map(ask, range(8)), wants))
            assert all(got == want for got, want in results), name
            assert server.client().models.list().data[0].id == NAME
        finally:
            server.stop()


# OpenAI's documented request fields (chat completions and completions, 2026), each with a value
# that asks for something: HONOURED ones change the answer as documented, the others get a 400
# naming the field. Written from OpenAI's API reference, not from the server's code.
CHAT_FIELDS = {
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}], "logit_bias": {"97": 2.0}, "logprobs": True,
    "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"k": "v"}, "modalities": ["text", "audio"], "n": 2,
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k", "reasoning_effort": "low", "response_format": {"type": "json_object"},
    "safety_identifier": "u1", "seed": 3, "service_tier": "flex", "stop": ["zz"], "store": True, "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.5,
    "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "top_logprobs": 2, "top_p": 0.5, "user": "u1", "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
}
COMPLETION_FIELDS = {
    "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"97": 2.0}, "logprobs": 2, "max_tokens": 3,
    "n": 2, "presence_penalty": 0.5, "seed": 3, "stop": ["zz"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": "end", "temperature": 0.5, "top_p": 0.5, "user": "u1",
}
HONOURED = {"frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "presence_penalty",
            "response_format", "safety_identifier", "seed", "stop", "stream", "temperature", "top_p", "user"}
NEEDS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}}  # fields that need another


@pytest.mark.parametrize("path, fields", [("chat/completions", CHAT_FIELDS), ("completions", COMPLETION_FIELDS)])
def test_every_openai_request_field_is_honoured_or_refused_by_name(server, path, fields):
    """No field is silently ignored: each of OpenAI's fields is honoured (200) or answered 400 with
    its name as `param`; so is a field OpenAI does not have, and one inside a message."""
    base = ({"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            if path == "chat/completions" else {"model": NAME, "prompt": "hi", "max_tokens": 3})
    for name, value in fields.items():
        r = httpx.post(f"{server.url}/v1/{path}", json={**base, **NEEDS.get(name, {}), name: value})
        if name in HONOURED or name in NEEDS:
            assert r.status_code == 200, (name, r.text)
        else:
            assert error(r, 400, name)["message"].startswith(name) or name == "n", name
    error(httpx.post(f"{server.url}/v1/{path}", json={**base, "guided_json": {"type": "object"}}), 400, "guided_json",
          "unsupported_field")
    if path == "chat/completions":
        message = {"role": "user", "content": "hi", "name": "ann"}
        error(httpx.post(f"{server.url}/v1/{path}", json={**base, "messages": [message]}), 400, "messages.0.name")
        calls = {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}
        error(httpx.post(f"{server.url}/v1/{path}", json={**base, "messages": [calls]}), 400, "messages.0.tool_calls")
        ok = httpx.post(f"{server.url}/v1/{path}", json={**base, "response_format": {"type": "text"}, "tools": [],
                                                          "tool_choice": "none", "store": False, "n": 1})
        assert ok.status_code == 200, ok.text
        error(httpx.post(f"{server.url}/v1/{path}", json={**base, "top_logprobs": 2}), 400, "top_logprobs")
    error(httpx.post(f"{server.url}/v1/{path}", json={**base, "stream_options": {"include_usage": True}}), 400,
          "stream_options")


def test_penalties_and_logit_bias_give_generates_tokens(server, medusa):
    """frequency/presence/repetition penalties and logit_bias reach the engine: the answer equals
    medusa.generate with the same settings (which equals plain decoding, tests/test_engine.py)."""
    client = server.client()
    settings = dict(frequency_penalty=1.2, presence_penalty=0.4, logit_bias={"101": 4.0})
    want = medusa.generate("the the the", chat=False, max_new_tokens=24, frequency_penalty=1.2, presence_penalty=0.4,
                           logit_bias={101: 4.0})
    assert want.text != medusa.generate("the the the", chat=False, max_new_tokens=24).text
    out = client.completions.create(model=NAME, prompt="the the the", max_tokens=24, temperature=0, **settings)
    assert out.choices[0].text == want.text
    rep = medusa.generate("the the the", chat=False, max_new_tokens=24, repetition_penalty=1.5)
    out = client.completions.create(model=NAME, prompt="the the the", max_tokens=24, temperature=0,
                                    extra_body={"repetition_penalty": 1.5})
    assert out.choices[0].text == rep.text
    error(httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "hi", "logit_bias": {"x": 1}}),
          400, "logit_bias")
    error(httpx.post(f"{server.url}/v1/completions", json={"model": NAME, "prompt": "hi", "frequency_penalty": 3}),
          400, "frequency_penalty")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_models_in_chat_and_completions(server, medusa, stream):
    """logprobs / top_logprobs: each token's log-probability from the verification pass, equal to
    plain decoding's (engine) to 1e-4, in OpenAI's chat and completions forms; the tokens' texts
    join up to the answer."""
    client = server.client()
    prompt = "The quick brown fox"
    want = medusa.generate(prompt, chat=False, max_new_tokens=10, use_medusa=False, logprobs=2)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, logprobs=2, stream=stream)
    chunks = list(out) if stream else [out]
    blocks = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for b in blocks for t in b.tokens]
    values = [v for b in blocks for v in b.token_logprobs]
    offsets = [v for b in blocks for v in b.text_offset]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "".join(tokens) == text == want.text and len(values) == 10
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    assert all(abs(v - w[0]) < 1e-4 for v, w in zip(values, want.logprobs))
    assert all(len(b) == 2 for blk in blocks for b in blk.top_logprobs)
    messages = [{"role": "user", "content": prompt}]
    want = medusa.generate(messages, max_new_tokens=8, use_medusa=False, logprobs=3)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=stream)
    chunks = list(out) if stream else [out]
    content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(content) == 8 and all(abs(t.logprob - w[0]) < 1e-4 for t, w in zip(content, want.logprobs))
    assert all(abs(a.logprob - v) < 1e-4 for t, w in zip(content, want.logprobs) for a, (_, v) in zip(t.top_logprobs, w[1]))
    assert [len(t.top_logprobs) for t in content] == [3] * 8
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_answers_own_ids(server, medusa, stream):
    """return_token_ids (as vLLM): the choice's ids are the engine's tokens for the answer, chunk by
    chunk when streamed; without it a choice has no token_ids."""
    client = server.client()
    want = medusa.generate("def f(x):", chat=False, max_new_tokens=12)
    out = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=12, temperature=0, stream=stream,
                                    extra_body={"return_token_ids": True})
    chunks = list(out) if stream else [out]
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert ids == want.token_ids and "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    messages = [{"role": "user", "content": "Hello there"}]
    want = medusa.generate(messages, max_new_tokens=8)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0, stream=stream,
                                         extra_body={"return_token_ids": True})
    chunks = list(out) if stream else [out]
    assert [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == want.token_ids
    plain = client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_metrics_count_what_the_answers_say(medusa):
    """GET /metrics parses as Prometheus text, and its counters add up to the answers' own
    figures: completion and prompt tokens, row steps, accepted candidates in total and per depth
    (streamed provenance). The drafter proposes the first prompt's plain answer: deep paths accepted."""
    from collections import Counter

    from prometheus_client.parser import text_string_to_metric_families

    from test_engine import _Oracle

    target = medusa.generate(PROMPTS[0], chat=False, max_new_tokens=40, use_medusa=False).token_ids
    oracle = MedusaModel(medusa.base, medusa.tokenizer, heads=_Oracle(target), ngram=None, name=NAME)
    s = Server(create_app(oracle, max_batch_size=4, adaptive=False))
    try:
        client = s.client()
        completion = prompt_tokens = steps = accepted = 0
        depths = Counter()
        for i, prompt in enumerate(PROMPTS):
            chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=6 + 4 * i, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            completion += chunks[-1].usage.completion_tokens
            prompt_tokens += chunks[-1].usage.prompt_tokens
            extras = [c.model_extra.get("medusa") or {} for c in chunks]
            steps += next(e["steps"] for e in extras if "steps" in e)
            accepted += sum(t["depth"] > 0 for e in extras for t in e.get("tokens", []))
            depths.update(t["depth"] for e in extras for t in e.get("tokens", []) if t["depth"] > 0)
        httpx.post(f"{s.url}/v1/completions", json={"model": NAME, "prompt": "hi", "n": 3})
        r = httpx.get(f"{s.url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for family in text_string_to_metric_families(r.text) for x in family.samples}
        value = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]  # noqa: E731
        assert value("medusa:generation_tokens_total") == completion
        assert value("medusa:prompt_tokens_total") == prompt_tokens
        assert value("medusa:row_steps_total") == steps
        assert value("medusa:spec_decode_num_accepted_tokens_total") == accepted
        per_pos = {int(dict(labels)["position"]) + 1: v for (name, labels), v in samples.items()
                   if name == "medusa:spec_decode_num_accepted_tokens_per_pos_total"}
        assert per_pos == dict(depths) and max(depths) >= 3  # deep candidates were accepted, and counted there
        assert sum(per_pos.values()) == accepted and value("medusa:spec_decode_num_draft_tokens_total") >= accepted
        drafts = value("medusa:spec_decode_num_drafts_total")
        assert abs(value("medusa:mean_accepted_length") - (1 + accepted / drafts)) < 1e-9
        assert value("medusa:requests_total", route="/v1/completions", status="200") == len(PROMPTS)
        assert value("medusa:requests_total", route="/v1/completions", status="400") == 1
        assert value("medusa:num_requests_running") == 0 and value("medusa:num_requests_waiting") == 0
        assert value("medusa:step_seconds_count") == value("medusa:steps_total") > 0
        assert value("medusa:grammar_seconds_count") == 0  # no request had a grammar yet
        httpx.post(f"{s.url}/v1/chat/completions", json={"model": NAME, "max_tokens": 8, "temperature": 0,
                                                         "messages": [{"role": "user", "content": "hi"}],
                                                         "response_format": {"type": "json_object"}})
        samples = {(x.name, tuple(sorted(x.labels.items()))): x.value
                   for family in text_string_to_metric_families(httpx.get(f"{s.url}/metrics").text)
                   for x in family.samples}
        assert value("medusa:grammar_seconds_count") > 0 and value("medusa:grammar_seconds_sum") > 0
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_equal_generates_and_are_valid(server, medusa, stream):
    """response_format json_object / json_schema and the structured_outputs extension (regex,
    choice): the answer is valid and equals medusa.generate under the same grammar (which equals
    plain constrained decoding, tests/test_grammar.py)."""
    from medusa_decoding.config import Grammar

    client = server.client()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Weather as JSON"}]
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}},
              Grammar("json_schema", json.dumps(schema))),
             ({"response_format": {"type": "json_object"}}, Grammar("json_object")),
             ({"extra_body": {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}}, Grammar("regex", "[0-9]{3}-[a-z]{2}")),
             ({"extra_body": {"structured_outputs": {"choice": ["yes", "no (1+1)"]}}},
              Grammar("regex", "yes|no\\ \\(1\\+1\\)"))]
    for kwargs, grammar in cases:
        want = medusa.generate(messages, max_new_tokens=60, grammar=grammar)
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=60, temperature=0, stream=stream,
                                             **kwargs)
        text = ("".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream
                else out.choices[0].message.content)
        assert text == want.text, kwargs
    value = json.loads(medusa.generate(messages, max_new_tokens=60, grammar=cases[0][1]).text)
    assert set(value) == {"city", "sunny"} and isinstance(value["sunny"], bool)
    url = f"{server.url}/v1/chat/completions"
    base = {"model": NAME, "messages": messages, "max_tokens": 5}
    error(httpx.post(url, json={**base, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
          400, "response_format")
    error(httpx.post(url, json={**base, "response_format": {"type": "yaml"}}), 400, "response_format")
    error(httpx.post(url, json={**base, "structured_outputs": {"regex": "(unclosed"}}), 400, "structured_outputs")
    error(httpx.post(url, json={**base, "structured_outputs": {"regex": "a", "choice": ["b"]}}), 400, "structured_outputs")
    error(httpx.post(url, json={**base, "response_format": {"type": "json_object"},
                                "structured_outputs": {"regex": "a"}}), 400, "structured_outputs")


def test_rows_with_and_without_a_grammar_share_steps_and_answer_as_alone(server, medusa):
    """Concurrent requests, half under a JSON schema and half free, decoded in the same batched
    steps: each answer equals its request decoded alone (generate)."""
    from medusa_decoding.config import Grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    jobs = [(p, i % 2 == 0) for i, p in enumerate(PROMPTS * 2)]
    wants = [medusa.generate(p, chat=False, max_new_tokens=20, grammar=Grammar("json_schema", json.dumps(schema))
                             if constrained else None).text for p, constrained in jobs]

    def ask(job):
        prompt, constrained = job
        extra = {"structured_outputs": {"json": schema}} if constrained else {}
        return server.client().completions.create(model=NAME, prompt=prompt, max_tokens=20, temperature=0,
                                                  extra_body=extra).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    assert got == wants
    assert all(json.loads(t) for t, (_, constrained) in zip(got, jobs) if constrained)
