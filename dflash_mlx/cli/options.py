"""The Typer app and the options its commands share.

`App` turns a `DFlashError` raised by any command into one line on stderr and exit code 2, and
Ctrl-C / SIGTERM into a line and exit 130 / 143.
"""

from __future__ import annotations

import functools
import shutil
import sys
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from . import render, signals
from ..errors import DFlashError

DEFAULT_MAX_TOKENS = 256
DEFAULT_BLOCK_SIZE = None  # the registry entry's block_size, else registry.DEFAULT_BLOCK
RICH_HELP_COLUMNS = 100


class _Group(TyperGroup):
    """Click's usage errors (a bad option value, an unknown option or command) as one line on
    stderr and exit code 2, like every other bad input, instead of a usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except typer.TyperException as e:  # click's ClickException and its usage errors
            ctx = getattr(e, "ctx", None)
            if ctx is not None and type(e).__name__ == "NoArgsIsHelpError":  # no arguments
                typer.echo(ctx.get_help())
                sys.exit(e.exit_code)
            hint = f" (see `{ctx.command_path if ctx is not None else self.name} --help`)"
            render.error(" ".join(e.format_message().split()) + hint)
            sys.exit(getattr(e, "exit_code", 2))
        except typer.Abort:
            render.error("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


class App(typer.Typer):
    """A Typer app whose commands all turn a DFlashError into one line and exit code 2."""

    def __call__(self, *args, **kwargs):
        # Rich help panels squeeze option help into a narrow column below ~100 columns (and
        # tag every flag `<bool>`); plain help reads better there.
        self.rich_markup_mode = "rich" if shutil.get_terminal_size().columns >= RICH_HELP_COLUMNS \
            else None
        return super().__call__(*args, **kwargs)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)

        def decorator(f):
            @functools.wraps(f)
            def guarded(*a, **k):
                try:
                    return f(*a, **k)
                except DFlashError as e:
                    render.error(str(e))
                    raise typer.Exit(2) from None
                except KeyboardInterrupt as e:  # where a command has no stopping point of its own
                    signals.settle()
                    render.note("interrupted")
                    raise typer.Exit(signals.exit_code(e)) from None

            register(guarded)
            return f

        return decorator


app = App(
    name="dflash-mlx",
    cls=_Group,
    help="Exact block-diffusion speculative decoding (DFlash) on MLX.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# Options shared by the commands that load a pair (generate, benchmark, chat, ...).
M, S = "Model", "Sampling"
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help="models.toml name, Hub repo id or local path (default: the embedded demo "
    "pair).", rich_help_panel=M)]
DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", "--draft-model", help="DFlash draft repo id or path (default: from models.toml).",
    rich_help_panel=M)]
NoDraftOpt = Annotated[bool, typer.Option(
    "--no-draft", help="Plain autoregressive decoding through the same target code.",
    rich_help_panel=M)]
DraftBitsOpt = Annotated[Optional[int], typer.Option(
    "--draft-bits", help="Quantize the draft at load to 4 or 8 bits (group 64); 16 keeps it. "
    "Default: 4 where the target stays quantized (a GPU), 16 where it runs dense (the CPU's "
    "float32), which dequantizes the draft anyway.", show_default=False, rich_help_panel=M)]
WeightsOpt = Annotated[str, typer.Option(
    help="auto | quantized | float32 | bfloat16. auto: float32 on the CPU device (so wider "
    "verify pays), as loaded on a GPU.", rich_help_panel=M)]
MinConfidenceOpt = Annotated[Optional[float], typer.Option(
    "--min-confidence", help="Verify the leading drafted tokens only while the draft's joint "
    "probability that all of them are right (the product of their slot probabilities) is at least "
    "this; 0 verifies whole blocks. Default: 0.05 on the CPU device (every verified token costs "
    "there), 0 on a GPU. The output is the target's either way.",
    rich_help_panel=M, show_default=False)]
LookupOpt = Annotated[bool, typer.Option(
    "--lookup/--no-lookup", help="Where the draft is unsure, try the tokens that followed the same "
    "words earlier in the conversation (v1 drafts). The output is the target's either way.",
    rich_help_panel=M)]
PadVerifyOpt = Annotated[bool, typer.Option(
    "--pad-verify/--no-pad-verify", help="On the CPU, run a verify pass at a wider width where "
    "this machine's BLAS does that faster (measured once, see `doctor`); the added rows are "
    "padding, never read.", rich_help_panel=M)]
BlockSizeOpt = Annotated[Optional[str], typer.Option(
    "--block-size", help="Verify width: the last token + B-1 drafted ones, 2..the draft's trained "
    "size; or 'auto' (from the measured verify cost on this machine, see `doctor`). Default: the "
    "models.toml entry's block_size, else 5.", rich_help_panel=M, show_default=False)]
TreeOpt = Annotated[str, typer.Option(
    "--tree", help="Verify a best-first tree of this many drafted tokens per round, built "
    "from the draft's top guesses at each slot (DDTree), instead of one path; 0: one path. "
    "auto: 8-64 where `doctor --model` measured that a wide verify pass costs about what the "
    "path's does (GPUs), else 0 (this CPU). v1 drafts on llama/qwen2/qwen3 targets. The "
    "output is the target's either way.", rich_help_panel=M)]
MaxTokensOpt = Annotated[int, typer.Option(help="Most tokens to generate.", rich_help_panel=S)]
TempOpt = Annotated[float, typer.Option(help="Sampling temperature; 0 is greedy.", rich_help_panel=S)]
TopPOpt = Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].", rich_help_panel=S)]
TopKOpt = Annotated[int, typer.Option(help="Keep the k most likely tokens; 0 keeps all.",
                                      rich_help_panel=S)]
SeedOpt = Annotated[Optional[int], typer.Option(help="PRNG seed for sampling.", rich_help_panel=S)]
ReasoningOpt = Annotated[Optional[str], typer.Option(
    help="off/on, or a level the model supports (see `dflash-mlx models`); passed to the chat "
    "template as the registry says.", rich_help_panel=S)]
SystemOpt = Annotated[Optional[str], typer.Option("--system-prompt", help="System message.",
                                                  rich_help_panel=S)]
NoTemplateOpt = Annotated[bool, typer.Option(
    "--no-chat-template", help="Tokenize the prompt as is.", rich_help_panel=S)]
R = "Remote server"
BackendOpt = Annotated[str, typer.Option(
    help="local: run the engine here. openai: drive an OpenAI-compatible server at --base-url "
    "(dflash-mlx serve, vLLM, SGLang, llama.cpp, mlx_lm.server); --model is then the served "
    "model name (default: the server's).", rich_help_panel=R)]
BaseUrlOpt = Annotated[Optional[str], typer.Option(
    help="The server, e.g. http://127.0.0.1:8000/v1.", rich_help_panel=R)]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    envvar="DFLASH_MLX_API_KEY", help="Bearer token for the server.", rich_help_panel=R)]
