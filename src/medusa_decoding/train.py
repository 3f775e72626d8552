"""Drafter training on a frozen base model, on HF Accelerate: one loop for every drafter kind.

Glossary: H cached hidden states (every token of every conversation), K heads (depths), D hidden
size, V vocabulary, B items per step and process.

Stages:
  1. features: the base's hidden states of every conversation, recorded by distill-data (the
     base does not run) or by one base forward per conversation cached in shards (resumable);
  2. train: the drafter on shuffled batches of those features; what differs between kinds (its
     weights, items, loss and batches) is its registry entry's training.Trainer;
  3. evaluate: top-1 / top-5 per depth on held-out conversations -> metrics.json.

The same command runs in one CPU process or under `accelerate launch` on N processes/GPUs;
Accelerate owns the process group and the gradient all-reduce.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import MedusaError, TrainConfig
from .data import FEATURES_DIR, StopSignal, conversations, tokenize_conversation
from .drafters import fused_layers

log = logging.getLogger(__name__)

SHARD_CONVERSATIONS = 256  # conversations per feature shard: the unit of resumption


def end_process_group() -> None:
    """Destroy the process group `accelerate launch` made, if one is alive (an atexit handler)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def feature_shards(model, tokenizer, cfg: TrainConfig, split: str, folder: Path, limit: int | None,
                   is_main: bool, progress: bool = True, layers: list[int] | None = None) -> tuple[list[Path], Counter]:
    """Cache the base model's last hidden states of a split's conversations in shards of
    SHARD_CONVERSATIONS, each a safetensors file with hidden [H_s, D], ids [H_s],
    mask [H_s] and offsets [S+1]; with `layers` (fused features, the last one the base's last),
    also lower [H_s, (k-1) D], the other layers' states. Existing shards are kept (resumption);
    a distill-data folder holds the same shards, written while it decoded."""
    from tqdm import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    max_length = min(cfg.max_length, model.config.get_text_config().max_position_embeddings)
    fingerprint = {"model": cfg.model, "data": cfg.data, "max_length": max_length, "dtype": str(model.dtype),
                   "shard_conversations": SHARD_CONVERSATIONS}
    if layers:
        fingerprint["layers"] = list(layers)
    stamp = folder / "fingerprint.json"
    if is_main:
        if stamp.is_file() and json.loads(stamp.read_text()) != fingerprint:
            raise MedusaError(f"{folder} caches features of other data or settings ({stamp}); use another --out")
        stamp.write_text(json.dumps(fingerprint) + "\n")
    counts: Counter = Counter()
    shards: list[Path] = []
    pending: list = []
    bar = tqdm(total=limit, desc=f"features ({split})", unit="conv", disable=not (progress and is_main))

    def write(shard: Path) -> None:
        if is_main and not shard.is_file():
            hidden, lower, ids, masks, offsets = [], [], [], [], [0]
            with torch.inference_mode():
                for ex in pending:
                    out = model.get_decoder()(input_ids=ex.input_ids[None].to(model.device),
                                              output_hidden_states=bool(layers))
                    hidden.append(out.last_hidden_state[0].to("cpu", model.dtype))
                    if layers:
                        lower.append(torch.cat([out.hidden_states[i][0] for i in layers[:-1]], -1).to("cpu", model.dtype))
                    ids.append(ex.input_ids)
                    masks.append(ex.loss_mask)
                    offsets.append(offsets[-1] + ex.input_ids.numel())
                    bar.update(1)
            tmp = shard.with_suffix(".tmp")
            tensors = {"hidden": torch.cat(hidden).contiguous(), "ids": torch.cat(ids),
                       "mask": torch.cat(masks).to(torch.uint8), "offsets": torch.tensor(offsets)}
            if layers:
                tensors["lower"] = torch.cat(lower).contiguous()
            save_file(tensors, tmp)
            tmp.rename(shard)
        else:
            bar.update(len(pending))
        shards.append(shard)

    n = 0
    for _, messages in conversations(cfg.data, counts, split=split):
        if limit is not None and n >= limit:
            break
        ex = tokenize_conversation(tokenizer, messages, max_length)
        if ex is None:
            counts["no assistant token within max_length"] += 1
            continue
        if ex.input_ids.numel() == max_length:
            counts[f"truncated to {max_length} tokens"] += 1
        pending.append(ex)
        n += 1
        if len(pending) == SHARD_CONVERSATIONS:
            write(folder / f"{split}-{len(shards):05d}.safetensors")
            pending = []
    if pending:
        write(folder / f"{split}-{len(shards):05d}.safetensors")
    bar.close()
    counts[f"{split} conversations"] = n
    return shards, counts


@dataclass
class Run:
    """What every stage of one training run shares: its folder and its processes."""

    cfg: TrainConfig
    out: Path  # the heads, checkpoint/, features/, log.jsonl, metrics.json
    accelerator: object  # accelerate.Accelerator: processes, device, precision
    progress: bool = True

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint"

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def save_config(self) -> None:
        if self.is_main:
            (self.out / "train_config.json").write_text(json.dumps(asdict(self.cfg), indent=2) + "\n")


@dataclass
class Features:
    """The base's recorded hidden states of the training and held-out conversations."""

    train: list[Path]  # shards
    eval: list[Path]
    layers: list[int] | None  # the recorded layers (None: the last one's alone)
    counts: Counter  # what was read or skipped, for the log and metrics.json


def train(cfg: TrainConfig, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train a drafter of kind cfg.drafter on the frozen base; return the final metrics. `resume`
    continues from the checkpoint in cfg.out (optimizer, scheduler, data position). `stop_after`
    (tests) simulates a kill after that many optimizer steps, leaving a checkpoint."""
    from . import proposers
    from .models import load_base

    trainer = proposers.trainer_for(cfg.drafter)(cfg)  # what differs between kinds: training.Trainer
    run = start_run(cfg, resume, progress)

    # 1. features: recorded by distill-data, or the frozen base runs once per conversation
    base, tokenizer, _ = load_base(cfg.model, dtype=cfg.dtype, device=str(run.accelerator.device))
    if tokenizer.chat_template is None:
        raise MedusaError(f"{cfg.model} has no chat template: head training renders chat conversations")
    features = record_features(run, trainer, base, tokenizer)

    # 2. weights (fresh or a warm start) and the items they train on
    lm_head = base.get_output_embeddings().float().requires_grad_(False)
    embed = base.get_input_embeddings().float().requires_grad_(False) if trainer.reads_embeddings else None
    if cfg.init is not None:  # a warm start: the checkpoint's weights, shape and shortlist
        heads = initial_weights(cfg, base, trainer)
        run.cfg = cfg = trainer.cfg = replace(cfg, num_heads=trainer.num_heads(heads))
        run.save_config()
        if run.is_main:
            log.info("warm start from %s (%d heads)", cfg.init, cfg.num_heads)
    else:
        heads = trainer.new_weights(base, features.layers)
    heads = heads.float().train().requires_grad_(True)
    del base
    data = trainer.load(features.train, cfg.max_conversations)
    trainer.prepare(heads, data, lm_head, embed, warm=cfg.init is not None)
    if run.is_main and trainer.label_map is not None:
        log.info("vocabulary losses on the %d most frequent label tokens", trainer.train_head.out_features)

    # 3. train: shuffled batches, checkpoints, a log line every cfg.log_every steps
    heads, step = optimize(run, trainer, heads, data, resume, stop_after)
    if heads is None:
        return {"interrupted_at": step}

    # 4. evaluate on held-out conversations, save the heads
    from accelerate.utils import gather_object

    unwrapped = run.accelerator.unwrap_model(heads).eval()
    metrics = {"drafter": cfg.drafter, **trainer.metrics(),
               "feature_layers": list(features.layers) if trainer.fused else None, "train_items": len(data),
               "steps": step, "data": dict(features.counts),
               "weights_sha256_per_process": gather_object([weights_digest(unwrapped)])}
    if features.eval:
        metrics["eval"] = trainer.evaluate(unwrapped, features.eval, cfg.eval_conversations, lm_head, embed)
    if run.is_main:
        unwrapped.save_pretrained(run.out)
        (run.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def start_run(cfg: TrainConfig, resume: bool, progress: bool) -> Run:
    """The run's folder (refused where it holds a checkpoint and --resume is not given), its
    processes and precision (auto: bf16 where the hardware has it), its seed."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from .models import resolve_device
    from .platform import native_bf16

    out = Path(cfg.out)
    state = out / "checkpoint" / "trainer_state.json"
    if state.is_file() and not resume:
        raise MedusaError(f"{out} already holds a training checkpoint: pass --resume, or choose another --out")
    if resume and not state.is_file():
        raise MedusaError(f"--resume: no checkpoint in {out}")
    device = resolve_device(cfg.device)
    mp = cfg.mixed_precision
    if mp == "auto":  # bf16 autocast on a CPU without bf16 hardware is emulated: many times slower
        if device.type == "cpu":
            mp = "bf16" if native_bf16() else "no"
        else:
            mp = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    accelerator = Accelerator(mixed_precision=mp, cpu=device.type == "cpu", gradient_accumulation_steps=cfg.grad_accum)
    # a gloo process group left to the interpreter's finalization aborts the process now and then
    # ("terminate called without an active exception"): destroy it at exit, while Python is alive
    atexit.unregister(end_process_group)
    atexit.register(end_process_group)
    set_seed(cfg.seed)
    run = Run(cfg, out, accelerator, progress)
    if run.is_main:
        out.mkdir(parents=True, exist_ok=True)
    run.save_config()
    return run


def record_features(run: Run, trainer, base, tokenizer) -> Features:
    """The shards of a distill-data folder (checked to be of this model), or the base's features of
    cfg.data's conversations, cached in run.out/features by the main process (resumable)."""
    cfg = run.cfg
    distilled = distilled_folder(cfg.data)
    if distilled is not None:  # features recorded while the data was decoded: the base does not run
        recorded = json.loads((distilled / "fingerprint.json").read_text())
        if recorded["model"] != cfg.model:
            raise MedusaError(f"{distilled} holds features of {recorded['model']}, not {cfg.model}")
        layers = recorded["layers"]
        train_shards = sorted((distilled / FEATURES_DIR).glob("train-*.safetensors"))
        eval_shards = sorted((distilled / FEATURES_DIR).glob("eval-*.safetensors"))
        counts = Counter({"data": str(distilled), "train shards": len(train_shards), "eval shards": len(eval_shards)})
    else:
        layers = fused_layers(base.config.get_text_config().num_hidden_layers) if trainer.fused else None
        folder = run.out / "features"
        train_shards, counts = feature_shards(base, tokenizer, cfg, "train", folder, cfg.max_conversations,
                                              run.is_main, run.progress, layers)
        eval_shards, eval_counts = feature_shards(base, tokenizer, cfg, "eval", folder, cfg.eval_conversations,
                                                  run.is_main, run.progress, layers)
        counts.update({k if k.startswith("eval") else f"eval: {k}": v for k, v in eval_counts.items()})
    if trainer.fused and (not layers or len(layers) < 2):
        raise MedusaError(f"fused features need several layers; {cfg.data} recorded only {layers}")
    run.accelerator.wait_for_everyone()
    if run.is_main:
        log.info("data: %s", "; ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return Features(train_shards, eval_shards, layers, counts)


def prepare(run: Run, heads, total_steps: int, resume: bool):
    """The optimizer and its cosine schedule over `total_steps`, prepared by accelerate, and the step
    to start from (the checkpoint's when resuming) -> (heads, optimizer, scheduler, step)."""
    from transformers import get_cosine_schedule_with_warmup

    cfg, accelerator = run.cfg, run.accelerator
    optimizer = torch.optim.AdamW(
        (p for p in heads.parameters() if p.requires_grad), lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    scheduler = get_cosine_schedule_with_warmup(optimizer, min(cfg.warmup_steps, total_steps // 10 + 1),
                                                math.ceil(total_steps / cfg.grad_accum))
    heads, optimizer = accelerator.prepare(heads, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    step = 0
    if resume:
        accelerator.load_state(str(run.checkpoint))
        step = json.loads((run.checkpoint / "trainer_state.json").read_text())["step"]
        if run.is_main:
            log.info("resumed from %s at step %d", run.checkpoint, step)
    return heads, optimizer, scheduler, step


def optimize(run: Run, trainer, heads, data, resume: bool, stop_after: int | None):
    """The training loop over `data` -> (the trained, wrapped heads, steps); (None, step) where
    it was stopped (SIGINT/SIGTERM, or stop_after), its checkpoint saved."""
    from tqdm import tqdm

    cfg, accelerator = run.cfg, run.accelerator
    items, per_step = len(data), trainer.per_step(data)
    world, rank = accelerator.num_processes, accelerator.process_index
    steps_per_epoch = items // (per_step * world)
    if steps_per_epoch < 1:
        raise MedusaError(f"{items} {trainer.unit} are fewer than one batch of {per_step * world}")
    total_steps = max(1, math.floor(steps_per_epoch * cfg.epochs))
    heads, optimizer, scheduler, step = prepare(run, heads, total_steps, resume)

    def save_checkpoint() -> None:
        accelerator.wait_for_everyone()
        accelerator.save_state(str(run.checkpoint))
        if run.is_main:
            (run.checkpoint / "trainer_state.json").write_text(json.dumps({"step": step}) + "\n")
        accelerator.wait_for_everyone()

    stopper = StopSignal()
    log_file = (run.out / "log.jsonl").open("a") if run.is_main else None
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=not (run.progress and run.is_main))
    order, order_epoch = None, -1
    t0, seen = time.perf_counter(), 0
    try:
        while step < total_steps:
            epoch, offset = divmod(step, steps_per_epoch)
            if epoch != order_epoch:  # the same order on every process and after a resume
                order = trainer.order(data, per_step * world, torch.Generator().manual_seed(cfg.seed + epoch))
                order_epoch = epoch
            start = (offset * world + rank) * per_step
            idx = order[start : start + per_step]
            with accelerator.accumulate(heads), accelerator.autocast():
                loss, top1 = trainer.loss(heads, data, idx)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(heads.parameters(), cfg.max_grad_norm)
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
                optimizer.zero_grad()
            step += 1
            seen += trainer.seen(data, idx) * world
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                record = {"step": step, "epoch": step / steps_per_epoch, "loss": loss.item(),
                          "lr": scheduler.get_last_lr()[0], "top1": [round(x, 4) for x in top1.tolist()],
                          "positions_per_s": seen / (time.perf_counter() - t0)}
                bar.set_postfix(loss=f"{record['loss']:.3f}", top1="/".join(f"{x:.2f}" for x in top1.tolist()))
                if log_file:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
            stop_now = stopper.requested or (stop_after is not None and step >= stop_after)
            if step % cfg.save_every == 0 or stop_now:
                save_checkpoint()
            if stop_now:
                if run.is_main:
                    log.info("stopped at step %d; checkpoint saved: rerun the same command with --resume", step)
                return None, step
    finally:
        stopper.restore()
        bar.close()
        if log_file:
            log_file.close()
    save_checkpoint()
    return heads, step


def evaluate_checkpoint(heads: str | Path, data: str | Path, limit: int | None = None, unroll: int = 5) -> dict:
    """Held-out top-1 / top-5 per depth of a saved drafter (Medusa heads, hydra, eagle; "shipped":
    the default drafter shipped for the folder's model) on the held-out split of a distill-data folder, from its recorded features: only the base's
    embeddings and LM head are used. limit: the first `limit` held-out conversations; unroll:
    the depths an EAGLE drafter is scored at. Returns what metrics.json's "eval" holds."""
    from . import proposers
    from .models import load_base

    folder = distilled_folder(str(data))
    if folder is None:
        raise MedusaError(f"{data} is not a distill-data folder (it has no fingerprint.json)")
    recorded = json.loads((folder / "fingerprint.json").read_text())
    shards = sorted((folder / FEATURES_DIR).glob("eval-*.safetensors"))
    if not shards:
        raise MedusaError(f"{folder} holds no held-out conversations yet")
    if heads == "shipped":
        heads = shipped_checkpoint(recorded["model"], what=f"{recorded['model']}, the model of {folder}")
    base, _, _ = load_base(recorded["model"], dtype="float32", device="cpu")
    weights = proposers.load(heads, base).float().eval()
    layers = getattr(getattr(weights, "config", None), "feature_layers", None)
    if layers is not None and list(layers) != list(recorded["layers"]):
        raise MedusaError(f"{heads} reads layers {list(layers)}; {folder} recorded {recorded['layers']}")
    trainer = proposers.trainer_for(weights.kind)(TrainConfig(drafter=weights.kind, unroll=unroll))
    lm_head, embed = base.get_output_embeddings().float(), base.get_input_embeddings().float()
    with torch.no_grad():
        return trainer.evaluate(weights, shards, limit, lm_head, embed)


def shipped_checkpoint(model: str, kind: str | None = None, what: str = "") -> Path:
    """The folder of the drafter shipped for a built-in `model` (kind None: its default one)."""
    from .models import shipped_drafter

    path = shipped_drafter(model, kind)
    if path is None:
        raise MedusaError(f"no {kind + ' ' if kind else ''}drafter is shipped for {what or model}")
    return path


def initial_weights(cfg: TrainConfig, base, trainer):
    """The checkpoint `cfg.init` names ("shipped": the cfg.drafter kind shipped for cfg.model),
    loaded for `base` to be trained further: its kind must be cfg.drafter, and its trainer must
    accept it (e.g. fused features as the run asks); its shape and shortlist come with it."""
    from . import proposers

    path = shipped_checkpoint(cfg.model, cfg.drafter, cfg.model) if cfg.init == "shipped" else cfg.init
    if not Path(path).expanduser().is_dir():
        raise MedusaError(f"--init {cfg.init}: no such checkpoint folder")
    weights = proposers.load(path, base)
    if weights.kind != cfg.drafter:
        raise MedusaError(f"--init {cfg.init} holds a {weights.kind} drafter; pass --drafter {weights.kind}")
    trainer.check_warm_start(weights, cfg.init)
    return weights


def distilled_folder(data: str) -> Path | None:
    """`data` as a distill-data folder (features recorded as it decoded), or None."""
    path = Path(data)
    return path if path.is_dir() and (path / "fingerprint.json").is_file() else None


def weights_digest(module: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal across processes when the all-reduce worked."""
    import hashlib

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def metrics_table(metrics: dict) -> str:
    ev = metrics.get("eval")
    if not ev:
        return "no held-out conversations: no evaluation"
    rows = ["head  top-1  top-5  positions"]
    for k, (a, b, n) in enumerate(zip(ev["top1"], ev["top5"], ev["positions"]), start=1):
        rows.append(f"{k:>4}  {a:5.3f}  {b:5.3f}  {n:>9}")
    return "\n".join(rows)
