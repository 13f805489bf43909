"""What the command lines share: a usage error is one `error:` line, like every other error a user
causes (one_line_errors), and a reader of stdout that goes away (`| head`) ends a command quietly."""

import argparse
import builtins
import functools
import os
import sys

from .errors import AnectypesError


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (subcommands included) whose usage errors are one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def at_least(low):
    """An argparse type: an integer >= low. A usage error then names the flag and the bound
    ("argument --steps: must be >= 1, got 0")."""
    def int(text):                               # argparse names the type by __name__: "invalid int value"
        value = builtins.int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return int


def quiet_on_closed_stdout(main):
    """main, which stops quietly with exit 141, as a program killed by SIGPIPE, when stdout's reader
    goes away (`| head`): Python ignores SIGPIPE and raises BrokenPipeError at the next write."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # for the exit's own flush
            return 141
    return wrapped


def one_line_errors(main):
    """main, whose AnectypesError (what a user caused) is one `error:` line on stderr and exit 1, and whose
    Ctrl-C ends the line and exits 130, without a traceback."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except AnectypesError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
    return wrapped
