"""What the command lines share: a usage error is one `error:` line, like every other error."""

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser (subcommands included) whose usage errors are one line on stderr, exit 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")
