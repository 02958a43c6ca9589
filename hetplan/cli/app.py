"""The ``hetplan`` command line: thin wrappers over library functions the tests call too.

Each subcommand lives in its own module (``compile``, ``show``, ``check``,
``exec``, ``profile``) and is imported only when used, so ``compile`` never imports torch.
A HetplanError becomes a one-line message on stderr and exit code 2; no traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
import warnings
from pathlib import Path

import click

from hetplan import __version__, env, progress
from hetplan.errors import HetplanError

_COMMANDS = {
    "compile": ("hetplan.cli.compile", "Plan a model on a machine (exact MILP by default)."),
    "show": ("hetplan.cli.show", "Explain a plan: blocks, memory, predictions, bottleneck; draw its timeline."),
    "export": ("hetplan.cli.export", "Write a plan as llama.cpp, Accelerate, vLLM or kTransformers settings, priced."),
    "check": ("hetplan.cli.check", "Recompile plans from their inputs and fail on regressions (CI)."),
    "exec": ("hetplan.cli.exec", "Execute a plan with the torch runtime and compare with its prediction."),
    "profile": ("hetplan.cli.profile", "Measure this machine and write node.yaml + node.profile.json."),
    "serve": ("hetplan.cli.serve", "Serve a plan over an OpenAI-compatible HTTP API (continuous batching, paged KV)."),
}


class _NonEmpty(click.ParamType):
    """A text value that is not empty: ``--cpu-mem ''`` or ``-o ''`` is a mistake, never "the
    default" nor "the current directory"."""
    name = "text"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("must not be empty (give a value, or leave the option out for its default)", param, ctx)
        return value


NONEMPTY = _NonEmpty()


class _Interrupted(Exception):
    """Ctrl-C during a command."""


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return list(_COMMANDS)

    def get_command(self, ctx, name):
        if name not in _COMMANDS:
            return None
        module = importlib.import_module(_COMMANDS[name][0])
        for param in module.command.params:  # every text flag and argument of every command
            if param.type is click.STRING:
                param.type = NONEMPTY
        return module.command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise _Interrupted() from None  # past click, which would print a blank line off a terminal too

    def format_commands(self, ctx, formatter):
        with formatter.section("Commands"):
            formatter.write_dl([(n, h) for n, (_, h) in _COMMANDS.items()])


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hetplan")
def cli():
    """hetplan: place every weight, KV cache and computation of an LLM across GPU HBM, CPU DRAM
    and PCIe, optimally for a stated objective, and run the plan."""


INSTALL_RUNTIME = {
    "CPU": "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install -e '.[runtime]'",
    "CUDA": "pip install -e '.[runtime]'",
}
"""The runtime's install lines (README "Install"): the CPU wheel index keeps pip from pulling a
multi-gigabyte CUDA build onto a machine without a GPU."""


def require_torch(command: str) -> None:
    """Refuse ``command`` with the install lines when torch cannot be imported.

    Before the import, torch's CPU allocator is asked for transparent huge pages on allocations
    of 2 MiB and more (``THP_MEM_ALLOC_ENABLE``, read once at the first allocation; a value the
    user set is kept): weights and caches then take 512 times fewer pages, and a process holding
    gigabytes exits on Ctrl-C in tens of milliseconds instead of the kernel freeing 4 KiB pages
    for a second on a loaded machine (bench/responsiveness.py)."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise HetplanError(f"hetplan {command} needs the torch runtime, which is not installed; on a CPU-only "
                           f"machine run `{INSTALL_RUNTIME['CPU']}`, on a CUDA machine `{INSTALL_RUNTIME['CUDA']}`"
                           ) from None


def main(argv=None) -> int:
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning(warnings.showwarning)
        rc = _main(argv)
    if rc == EXIT_INTERRUPTED and argv is None:
        # The console command, interrupted: nothing is left to write, and freeing a large solver
        # model on the way out would take seconds; leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _one_line_warning(show_other):
    """Show hetplan's own warnings (e.g. a profile measured on another machine) as one line on
    stderr, like errors; any other warning as ``show_other`` would."""
    def show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.split(".")[0] == "hetplan":
            click.echo(f"hetplan: warning: {message}", err=True)
        else:
            show_other(message, category, filename, lineno, file, line)
    return show


EXIT_OK, EXIT_REGRESSION, EXIT_USER, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
"""Exit codes (README "Exit codes"): ok; ``check`` found a regression; a mistake in the input;
a bug in hetplan; Ctrl-C."""
_REPORT = ("please report it with the command line that triggered it (HETPLAN_TRACEBACK=1 prints the "
           "traceback)")


def _main(argv=None) -> int:
    try:
        # progress lines say so, apart from the one line of an error (README "Exit codes")
        env.check()
        with progress.reporting(lambda text: click.echo(f"hetplan: progress: {text}", err=True)):
            rc = cli.main(args=argv, prog_name="hetplan", standalone_mode=False)
    except HetplanError as e:
        click.echo(f"hetplan: error: {one_line(str(e))}", err=True)
        return EXIT_USER
    except (click.exceptions.Abort, KeyboardInterrupt, _Interrupted):
        return _interrupted()
    except click.exceptions.NoArgsIsHelpError as e:  # `hetplan` alone: its help, as --help prints it
        click.echo(e.ctx.get_help())
        return EXIT_OK
    except click.UsageError as e:  # a bad option or argument: one line, like every other mistake
        command = e.ctx.command_path if e.ctx is not None else "hetplan"
        message = e.format_message().replace(":\n\t", ": ").replace(",\n\t", ", ")  # click's list of choices
        click.echo(f"hetplan: error: {one_line(message)} (see `{command} --help`)", err=True)
        return EXIT_USER
    except click.ClickException as e:
        click.echo(f"hetplan: error: {one_line(e.format_message())}", err=True)
        return EXIT_USER
    except click.exceptions.Exit as e:
        return e.exit_code
    except Exception as e:  # a bug: one line, never a traceback (HETPLAN_TRACEBACK=1 shows it)
        if env.switch("HETPLAN_TRACEBACK", False):  # checked when the command started
            raise
        where = traceback.extract_tb(e.__traceback__)[-1]
        click.echo(f"hetplan: internal error: {type(e).__name__}: {one_line(str(e))[:300]} (at "
                   f"{Path(where.filename).name}:{where.lineno}); this is a bug in hetplan, {_REPORT}",
                   err=True)
        return EXIT_INTERNAL
    return rc if isinstance(rc, int) else 0  # a command's click.exceptions.Exit(code) lands here


def one_line(text: str) -> str:
    """``text`` on one line, printable: control characters (a file name holding a newline) as
    escapes, and characters a file name can carry but no terminal can print (bytes that were
    not UTF-8) as ``\\udcXX``."""
    return "".join(ch if ch.isprintable() or ch == " " else ascii(ch)[1:-1] for ch in text)


def _interrupted() -> int:
    # on a terminal, end the line that holds the ^C echo (or a progress line) first
    click.echo(("\n" if sys.stderr.isatty() else "") + "hetplan: interrupted; nothing was written", err=True)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
