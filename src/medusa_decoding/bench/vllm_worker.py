"""One vLLM engine decoding token ids greedily, one JSON line a request: what `medusa bench`'s vLLM
methods (bench/vllm.py) and scripts/vllm_check.py talk to.

It runs in vLLM's own virtual environment (vLLM pins its own torch and transformers), started
by path with that environment's python; it imports nothing of this package, only vLLM and the
standard library.

    python vllm_worker.py --model DIR [--speculative JSON] [--dtype float32] [--max-model-len N]

stdout, one JSON object a line: {"ready": true, "load_s", "vllm", "threads"} once the engine is
up, then for each request read from stdin
    in:  {"prompt": [token ids], "max_tokens": N, "stop": [token ids]}
    out: {"tokens": [new token ids], "wall_s", "drafts", "draft_tokens", "accepted"}
(the last three: vLLM's speculative-decoding counters over this request; 0 without a drafter),
or {"error": "..."} for a request it could not decode. EOF on stdin ends it. vLLM's own logging
goes to stderr.
"""

import argparse
import ctypes
import json
import os
import signal
import sys
import time

COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters now (0 where it keeps none)."""
    out = dict.fromkeys(COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(getattr(metric, "value", 0))
    return out


def end_with(parent: int) -> None:
    """Never outlive `parent`: the kernel kills this process when its parent dies (Linux prctl);
    once loaded, EOF on stdin ends it anyway."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # gone before the kernel was told
        os._exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--speculative", default=None, help="vLLM's speculative_config, as JSON")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="KV cache size (vLLM's CPU backend otherwise reserves 92%% of the machine's memory)")
    parser.add_argument("--parent", type=int, default=None, help="end when this process ends")
    args = parser.parse_args()
    if args.parent is not None:
        end_with(args.parent)

    # one process (no engine-core child), so that closing stdin ends everything it started
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints; only the protocol goes to the real stdout

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = json.loads(args.speculative) if args.speculative else None
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0,
              speculative_config=speculative, disable_log_stats=False, enable_prefix_caching=False, skip_tokenizer_init=True,
              kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)))
    reply({"ready": True, "load_s": time.perf_counter() - t0, "vllm": vllm.__version__,
           "threads": torch.get_num_threads()})
    for line in sys.stdin:
        if not line.strip():
            break
        try:
            request = json.loads(line)
            params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]),
                                    stop_token_ids=list(request.get("stop", [])), detokenize=False)
            before = counters(llm)
            start = time.perf_counter()
            result = llm.generate(TokensPrompt(prompt_token_ids=list(request["prompt"])), params, use_tqdm=False)
            wall = time.perf_counter() - start
            after = counters(llm)
            reply({"tokens": list(result[0].outputs[0].token_ids), "wall_s": wall,
                   **{k: after[k] - before[k] for k in after}})
        except Exception as e:  # noqa: BLE001 - one bad request is answered, the engine stays up
            reply({"error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__":
    main()
