"""`lfa` command line (Click): parse, call the stage functions, print; one module per command group (machine,
plans, checks, runs). Exit codes: 0 ok, 1 failed run or findings, 2 usage or input error."""

from __future__ import annotations

import errno
import functools
import os
import sys

import click

from .. import UserError, __version__
from ..quoting import comment_text, has_surrogates


def _not_utf8_flags(kwargs: dict) -> list[str]:
    """The options and arguments whose value holds bytes that are not UTF-8 (Python's surrogate escapes)."""
    params = {p.name: p for p in click.get_current_context().command.params}
    found = []
    for name, value in kwargs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, str) and has_surrogates(v) for v in values):
            param = params.get(name)
            found.append(max(param.opts, key=len) if param is not None and param.opts else name)
    return found


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            not_text = _not_utf8_flags(kwargs)
            if not_text:  # paths and names lfa writes into recipes and scripts are text
                raise UserError(f"{', '.join(not_text)}: the value is not valid UTF-8 text")
            return fn(*args, **kwargs)
        except UserError as exc:  # messages quote what the user gave: no escape sequence reaches the terminal
            click.echo(f"lfa: error: {comment_text(exc, keep=chr(10))}", err=True)
            sys.exit(2)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # the reader went away (`lfa ... | head`): nothing left to tell
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(141)  # 128 + SIGPIPE, as shells report it
            if exc.errno != errno.ENOSPC:  # a path too long, a folder not writable: one message, no traceback
                where = f" ({comment_text(exc.filename)[:200]})" if exc.filename else ""
                click.echo(f"lfa: error: {exc.strerror or exc}{where}", err=True)
                sys.exit(2)
            click.echo(
                f"lfa: error: the disk is full ({exc.filename or 'writing'}): free space and run the command "
                "again (a training run resumes from its newest complete checkpoint)",
                err=True,
            )
            sys.exit(1)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lfa")
def main():
    """Fit a paper's full-SFT LLaMA-Factory recipe to your hardware, then keep the run alive.

    \b
    Example:
      lfa detect
      lfa generate --task pseudo2norm --hardware v100-32g -o recipes/mine
      lfa train recipes/mine/train.yaml
    """


# each module registers its commands on main
from . import checks, machine, plans, runs  # noqa: E402,F401
