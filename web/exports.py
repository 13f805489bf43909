"""A run's checkpoint in another tool's format (anectypes.formats), as one download: the .gguf file, or
an uncompressed zip of the llama2c or hf folder. Written in a temporary folder that goes after the
response is sent."""

import shutil
import tempfile
from pathlib import Path

from anectypes import sources
from anectypes.errors import AnectypesError
from anectypes.formats.export import export, zip_folder

from .api_errors import Conflict, NotFound


def export_run(run, body):
    """(the file to send, its download name, the temporary folder to remove after); Conflict when the
    run has no such checkpoint (confined to the run: Run.checkpoint) or its model cannot be written in
    the format (the reason as the detail)."""
    try:
        checkpoint = run.checkpoint(body.checkpoint)
    except NotFound:
        raise Conflict(f"cannot export: the run has no {body.checkpoint or 'best or latest'} checkpoint") from None
    tmp = Path(tempfile.mkdtemp(prefix="anectypes-export-"))
    name = f"{run.id}-{body.format}"
    try:
        model = sources.resolve(checkpoint, text=True)
        out = tmp / (name + ".gguf" if body.format == "gguf" else name)
        export(model, body.format, out, body.dtype)
        if out.is_dir():
            zip_folder(out, tmp / f"{name}.zip")
            out = tmp / f"{name}.zip"
        return out, out.name, tmp
    except (AnectypesError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Conflict(f"cannot export: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
