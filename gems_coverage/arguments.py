"""What the gems-coverage commands share about their arguments: the argument types, a parser that reports
bad input in one line, and the two errors the commands turn into exit codes (2 bad input, 1 a gate failed).
One place for them, so that the CLI and the torchrun recipe (gems_coverage.distributed) check alike."""
import argparse


class UsageError(Exception):
    """Bad input: one line on stderr, exit code 2."""


class GateFailed(Exception):
    """A gate failed (--fail-under, a parity mismatch): exit code 1."""


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageError: one line, no usage dump."""

    def error(self, message):
        raise UsageError(message)


def positive_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{s}'") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{s}'")
    return v


def nonneg_int(s):
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got '{s}'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got '{s}'")
    return v


def positive_float(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{s}'") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{s}'")
    return v


def unit_interval(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got '{s}'") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got '{s}'")
    return v


def percentage(s):
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got '{s}'") from None
    if not 0 <= v <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage between 0 and 100, got '{s}'")
    return v
