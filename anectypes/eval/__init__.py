"""The test-set loss and perplexity of a model source on the training kernels: `evaluate` and the command
(python -m anectypes.eval)."""

from .scoring import Result, evaluate, windows


def __getattr__(name):
    """main, imported when first asked for (as anectypes.generate does): the library needs no argparse."""
    if name == "main":
        from .command import main
        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Result", "evaluate", "main", "windows"]
