"""Text from a model on the CPU: sampling (the library the dashboard and training's samples use), the
KV-cache decoder, its worker lanes, and the command (python -m anectypes.generate)."""

from .sampling import Sampler, TextStream, generate, stream


def __getattr__(name):
    """main, imported when first asked for: a decode lane's process (python -m anectypes.generate.lanes)
    imports this package first, which must not import the decoder, and so lanes, before it."""
    if name == "main":
        from .command import main
        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Sampler", "TextStream", "generate", "main", "stream"]
