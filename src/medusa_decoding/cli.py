"""`medusa generate | ...`: parse the arguments, then call the library.

A user error prints one line `error: ...` to stderr and exits with status 2.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .config import DEFAULT_MODEL, MedusaError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Medusa speculative decoding for Hugging Face causal language models.")

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", help="Built-in alias, Hugging Face model folder or .gguf file.")
HeadsOpt = typer.Option(None, "--heads", help="Medusa heads folder; default: the heads shipped for the built-in model.")
DtypeOpt = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto (bf16 on CPU and recent GPUs).")
DeviceOpt = typer.Option("auto", "--device", help="cpu, cuda, cuda:N or auto.")


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def load_model(model: str, heads: Optional[Path], tree: Optional[Path], dtype: str, device: str, no_medusa: bool):
    from .engine import MedusaModel, shipped_heads

    if no_medusa:
        heads_arg = None
    elif heads is not None:
        heads_arg = heads
    else:
        heads_arg = shipped_heads(model)  # None when nothing is shipped: plain decoding
        if heads_arg is None and model == DEFAULT_MODEL:
            typer.echo(f"note: no heads given and none shipped for {model}: plain decoding", err=True)
    return MedusaModel.from_pretrained(model, heads=heads_arg, tree=tree, dtype=dtype, device=device)


@app.callback()
def _group() -> None:
    """Medusa speculative decoding for Hugging Face causal language models."""


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Wrap the prompt in the model's chat template (default: when it has one)."),
    model: str = ModelOpt,
    heads: Optional[Path] = HeadsOpt,
    tree: Optional[Path] = typer.Option(None, "--tree", help="Tree JSON file (list of paths); default: calibrated or built-in tree."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    acceptance: Optional[str] = typer.Option(None, "--acceptance", help="greedy, rejection (lossless) or typical (lossy); default: greedy at temperature 0, rejection otherwise."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    dtype: str = DtypeOpt,
    device: str = DeviceOpt,
    no_medusa: bool = typer.Option(False, "--no-medusa", help="Plain decoding through the same engine (the baseline)."),
) -> None:
    """Generate text for one prompt, streamed to stdout; a line of stats goes to stderr."""
    from .config import GenerationConfig, SamplingConfig

    if not prompt.strip():
        fail("the prompt is empty")
    GenerationConfig(max_new_tokens=max_new_tokens, stop=stop)  # validate before the model loads
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, acceptance=acceptance)
    SamplingConfig(**sampling)
    m = load_model(model, heads, tree, dtype, device, no_medusa)
    stream = m.stream(prompt, max_new_tokens=max_new_tokens, chat=chat, stop=stop, **sampling)
    for delta in stream:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    method = "plain" if m.heads is None else f"medusa ({m.tree.num_nodes}-node tree)"
    typer.echo(f"[{method}] {stream.stats.summary()}", err=True)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    from typer._click import exceptions as click  # typer vendors its own click

    try:
        code = app(standalone_mode=False)
    except MedusaError as e:
        typer.echo(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", err=True)
        sys.exit(2)
    except click.NoArgsIsHelpError:  # the help text is already printed
        sys.exit(0)
    except click.UsageError as e:  # bad or missing option: one line, and where to look
        hint = f" (see 'medusa {e.ctx.info_name} --help')" if e.ctx is not None else ""
        typer.echo(f"error: {e.format_message()}{hint}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        typer.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
