"""The builder of saved graphs (compile mode auto, verifiers/compiled.py): it loads the base (and a
drafter, for its drafting graphs) and builds the shapes runs listed in FOLDER/wanted/. It runs in
the foreground (`medusa compile`) or as the child process of a server, which it never outlives. It
sits above proposers and verifiers, which it both needs."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from . import proposers
from .config import CompileMode, MedusaError, Numerics
from .kernels import blocks
from .kernels.attention import register_attention
from .models import load_base
from .verifiers.compiled import (BUILDER_IDLE_S, LOCK, SPEC, WANTED, _draft, build_graph, builder_alive, dummy_args,
                                 graph_folder)

log = logging.getLogger(__name__)


def load_draft_module(base, folder: str) -> torch.nn.Module:
    """The drafting module of the drafter saved in `folder`, on `base` (the builder's)."""
    module = proposers.wrap(proposers.load(folder, base), base).draft_module()
    if module is None:
        raise MedusaError(f"the drafter in {folder} has no compiled drafting")
    return module


@contextlib.contextmanager
def builder_lock(folder: Path):
    """Hold FOLDER/builder.pid (one builder a folder) -> True, or False where a live builder holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if builder_alive(folder):
            yield False
            return
        lock.unlink(missing_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    try:
        yield True
    finally:
        lock.unlink(missing_ok=True)


def build_listed(folder: Path, run: torch.nn.Module, idle_s: float = 0.0, progress=None) -> int:
    """Build every shape listed in FOLDER/wanted/ (oldest first) on `run` (the layers a
    CompiledBackend runs), waiting up to idle_s for more once the list is done -> graphs built.
    progress: called with (graphs built, graphs left) after each one."""
    built = 0
    drafts: dict[str, torch.nn.Module] = {}  # drafter folder -> its drafting module
    idle_since = time.perf_counter()
    with torch.inference_mode():
        while True:
            wanted = sorted((folder / WANTED).glob("*.json"), key=lambda p: p.stat().st_mtime)
            todo = []
            for w in wanted:
                if (folder / (w.stem + ".pt2")).exists():
                    w.unlink(missing_ok=True)
                else:
                    todo.append(w)
            if not todo:
                if time.perf_counter() - idle_since >= idle_s:
                    return built
                time.sleep(0.5)
                continue
            record = json.loads(todo[0].read_text())
            t0 = time.perf_counter()
            if "draft" in record:  # a drafter's drafting (DraftGraphs): the run drafts eager without it
                draft = record["draft"]
                try:
                    if draft["folder"] not in drafts:
                        drafts[draft["folder"]] = load_draft_module(run, draft["folder"])
                    module = drafts[draft["folder"]]
                    key = (draft["width"], draft["depth"], draft["budget"])
                    build_graph((module, *module.dummy_inputs(), *key), folder / (todo[0].stem + ".pt2"), _draft)
                except Exception as e:  # noqa: BLE001 - the verify graphs still get built
                    log.error("cannot build %s (%s: %s)", todo[0].stem, type(e).__name__, e)
                    todo[0].unlink(missing_ok=True)
                    continue
            else:
                shape = record["shape"]
                shape = (*shape[:5], tuple(shape[5]) if shape[5] else None)
                build_graph(dummy_args(run, shape), folder / (todo[0].stem + ".pt2"))
            todo[0].unlink(missing_ok=True)
            built += 1
            log.info("built %s (%.0f s)", todo[0].stem, time.perf_counter() - t0)
            if progress is not None:
                progress(built, len(todo) - 1)
            idle_since = time.perf_counter()


def build_wanted(folder: Path, spec: dict) -> int:
    """The builder process: load the base as `spec` (FOLDER/builder.json) says, then build what is
    listed, waiting the spec's idle_s for more -> graphs built."""
    with builder_lock(folder) as held:
        if not held:
            return 0
        torch.set_num_threads(spec["threads"])
        model, _, _ = load_base(spec["model"], dtype=spec["dtype"], device=spec["device"])
        register_attention(exact=False), register_attention(exact=True)  # the package's kernels, by name
        model.set_attn_implementation(spec["attention"])
        numerics = Numerics.parse(spec.get("numerics", Numerics.FP32.value))
        if graph_folder(model, folder.parent, numerics) != folder:
            log.error("%s loads as another model or machine than %s's key: nothing built", spec["model"], folder)
            return 0
        run = blocks.block_linears(model, numerics=numerics) if blocks.on_blocks(model) else model  # what CompiledBackend runs
        return build_listed(folder, run, spec.get("idle_s", BUILDER_IDLE_S))


def compile_method(model, prompts: list[str], max_new_tokens: int, progress: bool = True) -> tuple[int, int]:
    """`medusa compile`: decode `prompts` with `model` (a MedusaModel on a compile-mode-auto backend; mode
    on in the int8 numerics, which compiles each shape as it is met) so that every shape its steps need
    is listed in the backend's folder (a shape already saved is loaded instead), then build all listed
    shapes in this process, a bar on stderr -> (graphs built, graphs the run loaded)."""
    from tqdm import tqdm

    backend = model.backend
    for prompt in tqdm(prompts, desc="listing shapes", unit="prompt", file=sys.stderr, disable=not progress):
        model.generate(prompt, max_new_tokens=max_new_tokens, ignore_eos=True)
    # compile mode on (the int8 numerics) compiles each new shape as the run meets it: those count as built
    met = len(backend.shapes) - backend.loaded if backend.mode is CompileMode.ON else 0
    listed = len(list((backend.folder / WANTED).glob("*.json")))
    with builder_lock(backend.folder) as held:
        if not held:
            raise MedusaError(f"a builder is at work on {backend.folder} (pid in {LOCK}): let it finish or end it")
        bar = tqdm(total=listed, desc="building graphs", unit="graph", file=sys.stderr, disable=not progress)
        built = build_listed(backend.folder, backend.model, 0.0, lambda done, left: bar.update(1))
        bar.close()
    return built + met, backend.loaded


PR_SET_PDEATHSIG = 1  # prctl(2)


def end_with_parent(parent: int) -> None:
    """Never outlive `parent`: the kernel kills this process when it dies (Linux), and a watch thread
    ends this process group (its compile workers too) once it is gone, where prctl is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    if os.getppid() != parent:  # gone before the kernel was told
        os.killpg(os.getpgrp(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()


def builder_main(folder: str) -> None:
    """The builder's child process (a server's): nice 19, logging to FOLDER/builder.log (its stdout),
    ending with the process that started it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = json.loads((Path(folder) / SPEC).read_text())
    if "parent" in spec:
        end_with_parent(spec["parent"])
    os.nice(19)
    log.info("built %d graphs", build_wanted(Path(folder), spec))
