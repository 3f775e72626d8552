"""The `@serve` run mode of `medusa bench`: one of our engine's methods answered by `medusa serve`'s
OpenAI-compatible server, started in this process on a loopback port and asked one request at a
time, so that its decoder has one row, as `generate` has. Beside the same method run directly it
shows the server's own cost (HTTP, JSON, the scheduler's loop, and its load-adaptive budget, as
`medusa serve` runs it) and that it decodes the same tokens (`return_token_ids`)."""

from __future__ import annotations

import socket
import threading
import time

from ..config import Grammar, GrammarKind, MedusaError
from .records import Generate, Turn, sync

START_S = 60.0  # how long the server may take to start listening


def structured_outputs(grammar: Grammar) -> dict:
    """A Grammar -> the request's `structured_outputs` extension (server/protocol.py's STRUCTURED)."""
    if grammar.kind is GrammarKind.JSON_SCHEMA:
        return {"json": grammar.source}
    if grammar.kind is GrammarKind.JSON_OBJECT:
        return {"json_object": True}
    return {"regex" if grammar.kind is GrammarKind.REGEX else "grammar": grammar.source}


def served_method(model, temperature: float) -> Generate:
    """`model`'s method through its own server, up for this bench run (generate.close stops it)."""
    import httpx

    from ..server import create_app, make_server

    app = create_app(model, max_batch_size=1)
    server = make_server(app, log_level="warning")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise MedusaError("the bench's in-process server did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/completions"
    client = httpx.Client(timeout=None)

    def generate(input_ids, max_new_tokens, seed, grammar=None):
        body = {"model": app.state.model_name, "prompt": input_ids[0].tolist(), "max_tokens": max_new_tokens,
                "temperature": temperature, "seed": seed, "return_token_ids": True}
        if grammar is not None:
            body["structured_outputs"] = structured_outputs(grammar)
        sync(model.device)
        t0 = time.perf_counter()
        response = client.post(url, json=body)
        wall = time.perf_counter() - t0
        if response.status_code != 200:
            raise MedusaError(f"the bench's server answered {response.status_code}: {response.text[:200]}")
        answer = response.json()
        choice, stats = answer["choices"][0], answer["medusa"]
        return Turn(choice["token_ids"], choice["text"], wall, steps=stats["steps"],
                    step_tokens=round(stats["mean_accepted_length"] * stats["steps"]))

    def close() -> None:
        server.should_exit = True
        thread.join(timeout=30)
        client.close()
        sock.close()

    generate.close, generate.constrains = close, True
    return generate
