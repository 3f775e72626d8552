"""The background builder of saved graphs (compile mode auto, verifiers/compiled.py): a process of
its own that loads the base (and a drafter, for its drafting graphs) and builds the shapes a run
asked for. It sits above proposers and verifiers, which it both needs."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from . import proposers
from .config import MedusaError
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


def build_wanted(folder: Path) -> int:
    """The background builder: load the base as FOLDER/builder.json says, then build every shape
    listed in FOLDER/wanted/ (oldest first) until none has come for the spec's idle_s -> graphs built.
    One builder a folder (FOLDER/builder.pid)."""
    spec = json.loads((folder / SPEC).read_text())
    lock = folder / LOCK
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if builder_alive(folder):
            return 0
        lock.unlink(missing_ok=True)
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    built = 0
    try:
        torch.set_num_threads(spec["threads"])
        model, _, _ = load_base(spec["model"], dtype=spec["dtype"], device=spec["device"])
        register_attention(exact=False), register_attention(exact=True)  # the package's kernels, by name
        model.set_attn_implementation(spec["attention"])
        if graph_folder(model, folder.parent) != folder:
            log.error("%s loads as another model or machine than %s's key: nothing built", spec["model"], folder)
            return 0
        run = blocks.block_linears(model) if blocks.on_blocks(model) else model  # the layers CompiledBackend runs
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
                    if time.perf_counter() - idle_since >= spec.get("idle_s", BUILDER_IDLE_S):
                        break
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
                idle_since = time.perf_counter()
    finally:
        lock.unlink(missing_ok=True)
    return built


def builder_main(folder: str) -> None:
    """The background builder's process: nice 19, logging to FOLDER/builder.log (its stdout)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.nice(19)
    log.info("built %d graphs", build_wanted(Path(folder)))
