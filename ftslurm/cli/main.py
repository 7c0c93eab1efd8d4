"""The `ftslurm` command line.

Errors are caught in one place (`main`): an `FtslurmError` prints `Error: <one line>` on
stderr and exits with its code; bad usage exits 2 with one `Error:` line too (and a hint
where the mistake is a common one); a closed stdout (`ftslurm status | head -1`) ends quietly
with 0; anything else is one line and a hint (`ftslurm --debug ...` shows the traceback).
The exception classes are looked up in typer and in every click it may raise from (its own
copy since typer 0.22, the click package before), so no handler names a missing class.
"""

from __future__ import annotations

import errno
import inspect
import os
import shlex
import sys
import traceback
import typing
from typing import Annotated, Any

import typer

from ftslurm import __version__
from ftslurm.cli import daemon_cmds, nodes, report, status, submit, submit_options
from ftslurm.cli.mock import app as mock_app
from ftslurm.cli.scheduler import app as scheduler_app
from ftslurm.core.torchrun import TORCHRUN
from ftslurm.errors import FtslurmError

app = typer.Typer(
    name="ftslurm",
    help="Slurm-native fault tolerance for long distributed PyTorch training runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
# The commands, in the order `ftslurm --help` lists them.
app.command(context_settings={"allow_extra_args": False})(submit.submit)
app.command()(status.status)
app.command()(status.wait)
app.command()(submit.cancel)
app.command()(status.logs)
app.command()(status.watch)
app.add_typer(nodes.nodes_app, name="nodes")
app.add_typer(daemon_cmds.daemon_app, name="daemon")
report.register(app)
app.add_typer(scheduler_app, name="scheduler")
app.add_typer(mock_app, name="mock")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print ftslurm's version and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug", help="Show the traceback of an unexpected error (to report a bug)."
        ),
    ] = False,
) -> None:
    """Slurm-native fault tolerance for long distributed PyTorch training runs."""
    _DEBUG["on"] = debug


@app.command()
def version() -> None:
    """Print ftslurm's version."""
    typer.echo(__version__)


SCRIPT_ARGS_HINT = "put the script's own arguments after `--`: ftslurm submit train.py -- --lr 3e-4"
TORCHRUN_ARGS_HINT = (
    "put torchrun's arguments after `--`: ftslurm submit torchrun -- --nproc-per-node 2 train.py"
)


def _click_exceptions() -> list[Any]:
    """The exception modules of every click the installed typer may raise from: its own copy
    (`typer._click`, typer 0.22 and later) and the click package (earlier typer, and any
    code that raises click's own exceptions). Looked up by name: a module may lack any."""
    found = []
    try:
        from typer import _click  # type: ignore[attr-defined]

        found.append(getattr(_click, "exceptions", None))
    except ImportError:
        pass
    try:
        import click.exceptions

        found.append(click.exceptions)
    except ImportError:  # pragma: no cover - a typer without the click package
        pass
    return [m for m in found if m is not None]


def _classes(*names: str) -> tuple[type[BaseException], ...]:
    """The exception classes of these names in typer and in every click it may use."""
    found: list[Any] = [getattr(typer, n, None) for n in names]
    found += [getattr(module, n, None) for module in _click_exceptions() for n in names]
    return tuple(
        dict.fromkeys(c for c in found if isinstance(c, type) and issubclass(c, BaseException))
    )


def _usage_hint(exc: Exception, argv: list[str] | None) -> str | None:
    """A hint for a usage error people make often, or None."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command if ctx is not None else None
    if (
        type(exc).__name__ == "NoSuchOption"
        and command is not None
        and command.name == "submit"
        and _follows_an_argument(command, argv, getattr(exc, "option_name", None))
    ):
        words = sys.argv[1:] if argv is None else argv
        return TORCHRUN_ARGS_HINT if TORCHRUN in words else SCRIPT_ARGS_HINT
    return None


def _follows_an_argument(command: Any, argv: list[str] | None, option: str | None) -> bool:
    """Whether the unknown `option` comes after the command's first positional argument
    (a script's own option given without `--`), reading argv with the command's options."""
    words = list(sys.argv[1:] if argv is None else argv)
    if not option or command.name not in words:
        return False
    takes_value = {}
    for param in command.params:
        for opt in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())):
            takes_value[opt] = param.param_type_name == "option" and not (
                getattr(param, "is_flag", False) or getattr(param, "count", False)
            )
    words = words[words.index(command.name) + 1 :]
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return False
        if word == option or word.startswith(option + "="):
            return False  # reached before any argument
        if word.startswith("-") and word != "-":
            if takes_value.get(word) and "=" not in word:
                i += 1
        else:
            return option in words[i + 1 :] or any(
                w.startswith(option + "=") for w in words[i + 1 :]
            )
        i += 1
    return False


def _show_usage_error(exc: Exception, argv: list[str] | None) -> None:
    """A usage error in one line, `Error: <what> (see `ftslurm CMD --help`)`, then the hint
    for a common mistake, if any: never typer's usage box. A group given no command has
    shown its help already (click's NoArgsIsHelpError): nothing more to say."""
    if type(exc).__name__ == "NoArgsIsHelpError":
        return
    try:
        text = exc.format_message()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - any click: fall back on the exception's text
        text = str(exc)
    text = " ".join(str(text).split()) or type(exc).__name__
    ctx = getattr(exc, "ctx", None)
    path = getattr(ctx, "command_path", None) or "ftslurm"
    print(f"Error: {text} (see `{path} --help`)", file=sys.stderr)
    hint = _usage_hint(exc, argv)
    if hint:
        print(f"Hint: {hint}", file=sys.stderr)


def _closed_pipe(exc: BaseException) -> bool:
    """Whether `exc` is a write to a reader that went away (`ftslurm status | head -1`)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, BrokenPipeError) or (
            isinstance(exc, OSError) and exc.errno == errno.EPIPE
        ):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _quiet_stdout() -> None:
    """After the reader of stdout went away: point stdout at /dev/null, so that nothing
    written or flushed later (at exit included) raises again. Exit quietly, as `head`'s
    writers do."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


# Set by `ftslurm --debug`: an unexpected error shows its traceback.
_DEBUG = {"on": False}


def _unexpected(exc: BaseException, argv: list[str] | None) -> int:
    """One line for an error ftslurm did not anticipate (a bug): what it was and how to see
    the traceback; with --debug the traceback itself."""
    if _DEBUG["on"]:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        return 1
    words = list(sys.argv[1:] if argv is None else argv)
    again = " ".join(["ftslurm", "--debug", *(shlex.quote(w) for w in words)])
    text = " ".join(str(exc).split()) or "(no message)"
    print(f"Error: unexpected {type(exc).__name__}: {text[:300]}", file=sys.stderr)
    print(
        f"Hint: this is a bug in ftslurm; `{again[:200]}` shows the traceback to report",
        file=sys.stderr,
    )
    return 1


# What an option's value is, in words, by the type's name (click's words, which typer
# 0.22 and later replaced with `<int>`, `<str>`, `<list[str]>`).
_TYPE_WORDS = {
    "integer": "INTEGER",
    "int": "INTEGER",
    "float": "NUMBER",
    "text": "TEXT",
    "str": "TEXT",
    "path": "PATH",
    "file": "FILE",
    "boolean": "BOOLEAN",
    "bool": "BOOLEAN",
}


def _paragraphs(text: str) -> str:
    """A help text with each paragraph's lines joined (a docstring's line breaks are not
    the terminal's: the help wraps at word boundaries at the terminal's width)."""
    parts = [" ".join(p.split()) for p in inspect.cleandoc(text).split("\n\n")]
    return "\n\n".join(p for p in parts if p)


def _argument_word(param: Any) -> str:
    """An argument as the usage line shows it: RECIPE, [RUN], [ARGS]..."""
    word = (param.metavar or param.name or "ARG").upper()
    word = word if param.required else f"[{word}]"
    return word + ("..." if param.nargs != 1 else "")


def _type_word(param: Any) -> str:
    """INTEGER, NUMBER, TEXT, PATH, ...: from click's type, or typer's type descriptor."""
    kind = getattr(param, "type", None)
    if kind is not None:
        name = str(getattr(kind, "name", "") or "").lower().split(" ")[0]
    else:
        annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
        inner = typing.get_args(annotation)
        annotation = inner[0] if inner and typing.get_origin(annotation) is list else annotation
        name = str(getattr(annotation, "__name__", "") or "").lower()
    return _TYPE_WORDS.get(name, name.upper() or "VALUE")


def readable(command: Any) -> Any:
    """The click command tree with help a person reads: texts that wrap at word boundaries,
    placeholders as words (`RECIPE`, `INTEGER`, not `{recipe}`, `<int>`), flags without a
    type. Works on every typer and click that pyproject allows (public attributes, and
    `get_usage_pieces`, which both clicks call for the usage line)."""
    for attr in ("help", "short_help"):
        text = getattr(command, attr, None)
        if isinstance(text, str) and text:
            setattr(command, attr, _paragraphs(text))
    for param in getattr(command, "params", ()):
        if isinstance(getattr(param, "help", None), str):
            param.help = _paragraphs(param.help)
        if param.param_type_name == "argument":
            word = _argument_word(param)
            param.get_usage_pieces = lambda ctx, word=word: [word]
            param.metavar = (param.metavar or param.name or "ARG").upper() + (
                "..." if param.nargs != 1 else ""
            )
            if hasattr(param, "display_type_rich"):  # typer 0.22+: the name says it all
                param.display_type_rich = lambda ctx: None
        elif param.param_type_name == "option" and param.metavar is None:
            flag = getattr(param, "is_flag", False) or getattr(param, "count", False)
            many = getattr(param, "multiple", False)
            param.metavar = "" if flag else _type_word(param)
            if many and not flag:
                param.metavar += "..."
    plain_help = command.get_help_option

    def help_option(ctx: Any) -> Any:  # --help is a flag: no type shown
        option = plain_help(ctx)
        if option is not None and option.metavar is None:
            option.metavar = ""
        return option

    command.get_help_option = help_option
    for sub in getattr(command, "commands", {}).values():
        readable(sub)
    return command


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status. Every error ends in one line: an
    `FtslurmError` as `Error: ...` with its code, bad usage as one `Error:` line (exit 2), an
    interrupt as 130, a closed stdout quietly with 0, anything else as one line with a hint
    (`--debug` for the traceback)."""
    usage = _classes("ClickException")
    aborts = _classes("Abort")
    exits = _classes("Exit")
    _DEBUG["on"] = False
    submit.forget_submit()  # of an earlier call in this process (tests call main often)
    try:
        try:
            command = readable(typer.main.get_command(app))
            submit_options.put_in_panels(command.commands["submit"], submit_options.SUBMIT_PANELS)
            result = command.main(args=argv, prog_name="ftslurm", standalone_mode=False)
            if result == 130:  # typer 0.22 and later end a Ctrl-C so, returned here
                note = submit.interrupted_submit()
                if note:
                    print(note, file=sys.stderr)
            sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        except FtslurmError as exc:
            print(f"Error: {exc.user_message()}", file=sys.stderr)
            return exc.exit_code
        except usage as exc:  # bad usage: standalone mode is off
            _show_usage_error(exc, argv)
            return int(getattr(exc, "exit_code", 2))
        except exits as exc:  # raised outside typer's own handling (a callback)
            code = getattr(exc, "exit_code", getattr(exc, "code", 0))
            return code if isinstance(code, int) else 0
        except aborts as exc:  # click before typer 0.22 turns Ctrl-C into Abort
            print(submit.interrupted_submit() or "Aborted!", file=sys.stderr)
            return 130 if isinstance(exc.__cause__, KeyboardInterrupt) else 1
        except KeyboardInterrupt:
            print(submit.interrupted_submit() or "Aborted!", file=sys.stderr)
            return 130
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = 0 if exc.code is None else exc.code
                # typer's own answer to a closed pipe is exit 1 with stdout pacified
                if code == 1 and _closed_pipe(exc):
                    _quiet_stdout()
                    return 0
                return code
            print(f"Error: {exc.code}", file=sys.stderr)
            return 1
        return result if isinstance(result, int) else 0
    except BaseException as exc:  # noqa: BLE001 - the last resort: never a traceback
        if _closed_pipe(exc):
            _quiet_stdout()
            return 0
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        return _unexpected(exc, argv)


if __name__ == "__main__":
    sys.exit(main())
