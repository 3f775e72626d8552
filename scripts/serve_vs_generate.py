"""`medusa serve` at batch 1 vs `MedusaModel.generate` on the same prompts, the default method,
interleaved prompt by prompt: tokens/s and mean accepted length of each.

    .venv/bin/python scripts/serve_vs_generate.py --limit 1 -n 96

The server runs in this process (uvicorn in a thread, loopback only); one request at a time, so
its decoder has one active row, as `generate` does. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time

import openai

from medusa_decoding.bench import load_suite, select
from medusa_decoding.engine import MedusaModel
from medusa_decoding.models import shipped_drafter
from medusa_decoding.config import NgramConfig
from medusa_decoding.server import create_app, make_server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench prompts per category")
    ap.add_argument("-n", "--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    model = MedusaModel.from_pretrained(heads=shipped_drafter("smollm2-135m-instruct"), ngram=NgramConfig(), compile="off", exact=False, calibration="shipped",
                                        dtype=args.dtype, device="cpu")
    prompts = select(load_suite("spec-bench", args.limit), args.limit, 1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(create_app(model, max_batch_size=8), log_level="warning")
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="x", timeout=600)
    rows = []
    for i, p in enumerate(prompts):
        messages = [{"role": "user", "content": p.turns[0]}]
        t0 = time.perf_counter()
        out = model.generate(messages, max_new_tokens=args.max_new_tokens)
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        resp = client.chat.completions.create(model=model.name, messages=messages, max_tokens=args.max_new_tokens,
                                              temperature=0)
        srv_s = time.perf_counter() - t0
        if i == 0:
            continue  # warm-up
        rows.append({"generate_tps": len(out.token_ids) / gen_s, "serve_tps": resp.usage.completion_tokens / srv_s,
                     "generate_tau": out.stats.mean_accepted_length,
                     "serve_tau": resp.model_extra["medusa"]["mean_accepted_length"],
                     "same_text": resp.choices[0].message.content == out.text})
    server.should_exit = True
    ratio = statistics.median(r["serve_tps"] / r["generate_tps"] for r in rows)
    summary = {k: round(statistics.median(r[k] for r in rows), 3) for k in rows[0] if k != "same_text"}
    summary |= {"serve_vs_generate": round(ratio, 3), "same_text": sum(r["same_text"] for r in rows),
                "prompts": len(rows), "method": model.method().describe()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
