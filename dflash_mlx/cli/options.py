"""The Typer app and the options its commands share.

`App` turns a `DFlashError` raised by any command into one line on stderr and exit code 2, and
Ctrl-C / SIGTERM into a line and exit 130 / 143.
"""

from __future__ import annotations

import errno
import functools
import shutil
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from . import environment, render, signals
from ..bounds import CEILINGS
from ..errors import DFlashError, InvalidArgumentError

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
                    environment.check()
                    return f(*a, **environment.expand_paths(k))
                except DFlashError as e:
                    render.error(str(e))
                    raise typer.Exit(2) from None
                except OSError as e:  # out of descriptors: one line; anything else is a bug
                    if e.errno not in (errno.EMFILE, errno.ENFILE):
                        raise
                    render.error(f"{e.strerror}: raise the open-file limit (ulimit -n)")
                    raise typer.Exit(2) from None
                except MemoryError:  # an allocation MLX or Python refused (load, prefill)
                    render.error("out of memory: this needs more memory than this process can "
                                 "hold (a smaller model, context or --max-tokens?)")
                    raise typer.Exit(2) from None
                except KeyboardInterrupt as e:  # where a command has no stopping point of its own
                    signals.settle()
                    render.note("interrupted")
                    raise typer.Exit(signals.exit_code(e)) from None
                finally:  # an output file still being written when the command ended is dropped
                    from ..atomic import discard_pending

                    discard_pending()

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
AdaptiveOpt = Annotated[bool, typer.Option(
    "--adaptive/--fixed-width", help="Each round, speculate only while it beats plain decoding "
    "on this machine's measured round costs and the recent acceptance (more so with many "
    "requests at once); --fixed-width speculates every round. The output is the target's "
    "either way.", rich_help_panel=M)]
PadVerifyOpt = Annotated[bool, typer.Option(
    "--pad-verify/--no-pad-verify", help="On the CPU, run a verify pass at a wider width where "
    "this machine's BLAS does that faster (measured once, see `doctor`); the added rows are "
    "padding, never read.", rich_help_panel=M)]
BlockSizeOpt = Annotated[Optional[str], typer.Option(
    "--block-size", help="Verify width: the last token + B-1 drafted ones, 2..the draft's trained "
    "size; or 'auto' (from the measured verify cost on this machine, see `doctor`). Default: the "
    "models.toml entry's block_size, else 5.", rich_help_panel=M, show_default=False)]


def _tree_ceiling(value: str | None) -> str | None:
    """--tree's ceiling while the command line is parsed, before any model loads (the range
    and the word itself are checked by `engine.parse_tree`)."""
    text = "" if value is None else str(value).strip()
    if text.isdigit() and int(text) > CEILINGS["--tree"]:
        raise typer.BadParameter(f"at most {CEILINGS['--tree']} nodes, got {text}")
    return value


TreeOpt = Annotated[str, typer.Option(
    "--tree", callback=_tree_ceiling, help="Verify a best-first tree of this many drafted tokens per round, built "
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
SpecialTokensOpt = Annotated[str, typer.Option(
    "--special-tokens", help="text | parse: special-token text in a raw prompt (say "
    "<|im_end|>) stays ordinary text, or becomes the control token (parse: a template written "
    "by hand). Chat messages are always text.", rich_help_panel=S)]
R = "Remote server"
BackendOpt = Annotated[str, typer.Option(
    help="local: run the engine here. openai: drive an OpenAI-compatible server at --base-url "
    "(dflash-mlx serve, vLLM, SGLang, llama.cpp, mlx_lm.server); --model is then the served "
    "model name (default: the server's).", rich_help_panel=R)]
BaseUrlOpt = Annotated[Optional[str], typer.Option(
    help="The server, e.g. http://127.0.0.1:8000/v1.", rich_help_panel=R)]
ApiKeyOpt = Annotated[Optional[str], typer.Option(
    envvar="DFLASH_MLX_API_KEY", help="Bearer token for the server.", rich_help_panel=R)]

# The sampling controls beyond temperature/top-p/top-k (docs/controls.md), named as in
# mlx_lm.generate; `build_sampling` turns them into the one SamplingParams.
MinPOpt = Annotated[float, typer.Option(
    "--min-p", help="Keep the tokens at least this × as likely as the top one (before "
    "temperature); 0 keeps all.", rich_help_panel=S)]
RepetitionPenaltyOpt = Annotated[Optional[float], typer.Option(
    "--repetition-penalty", help="Penalize tokens among the last --repetition-context-size "
    "(above 1 discourages repeats); unset: none.", rich_help_panel=S, show_default=False)]
RepetitionContextOpt = Annotated[int, typer.Option(
    "--repetition-context-size", help="How many recent tokens the repetition penalty reads.",
    rich_help_panel=S)]
PresencePenaltyOpt = Annotated[Optional[float], typer.Option(
    "--presence-penalty", help="Subtract this from the logit of every token already among the "
    "last 20 (OpenAI's rule); unset: none.", rich_help_panel=S, show_default=False)]
FrequencyPenaltyOpt = Annotated[Optional[float], typer.Option(
    "--frequency-penalty", help="Subtract this once per occurrence among the last 20 tokens "
    "(OpenAI's rule); unset: none.", rich_help_panel=S, show_default=False)]
LogitBiasOpt = Annotated[Optional[str], typer.Option(
    "--logit-bias", help="Add to token logits: ID=VALUE,ID=VALUE or a JSON object "
    "'{\"ID\": VALUE}', values in [-100, 100].", rich_help_panel=S, show_default=False)]
G = "Structured output"
JsonSchemaOpt = Annotated[Optional[Path], typer.Option(
    "--json-schema", help="A file holding a JSON schema the output must match.",
    rich_help_panel=G, show_default=False)]
RegexOpt = Annotated[Optional[str], typer.Option(
    "--regex", help="A regular expression the whole output must match.", rich_help_panel=G,
    show_default=False)]
MAX_LOGPROBS = 20


def parse_logit_bias(text: str | None, flag: str = "--logit-bias") -> dict[int, float]:
    """`ID=VALUE,ID=VALUE` or a JSON object {"ID": VALUE}; a malformed value is one line."""
    if text is None:
        return {}
    text = text.strip()
    try:
        if text.startswith("{"):
            import json

            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg})") from None
            if not isinstance(raw, dict):
                raise ValueError("the JSON must be an object")
            pairs = list(raw.items())
        else:
            pairs = [item.split("=", 1) if "=" in item else (item, None)
                     for item in text.split(",") if item.strip()]
        if not pairs:
            raise ValueError("it is empty")
        bias = {}
        for key, value in pairs:
            if value is None:
                raise ValueError(f"{key.strip()!r} has no =VALUE")
            try:
                token = int(str(key).strip())
            except ValueError:
                raise ValueError(f"token id {str(key).strip()!r} is not an integer") from None
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"the value for token {token} is not a number")
            try:
                bias[token] = float(value)
            except ValueError:
                raise ValueError(f"the value for token {token} is not a number") from None
        return bias
    except ValueError as e:
        raise InvalidArgumentError(
            f"{flag} takes ID=VALUE,ID=VALUE or a JSON object {{\"ID\": VALUE}}: {e}") from None


def _read_schema(path: Path) -> str:
    from ..input_files import read_bytes

    try:  # a FIFO or a folder: one line, never a wait
        return read_bytes(path, "--json-schema").decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"--json-schema {path}: cannot read ({type(e).__name__})"
                                   ) from None


def build_sampling(*, temp: float, top_p: float, top_k: int, seed: int | None,
                   min_p: float = 0.0, repetition_penalty: float | None = None,
                   repetition_context_size: int = 20, presence_penalty: float | None = None,
                   frequency_penalty: float | None = None, logit_bias: str | None = None,
                   json_schema: Path | None = None, regex: str | None = None):
    """The one SamplingParams of a command, every value checked (a bad one: one line)."""
    from ..speculate.grammar import Constraint
    from ..speculate.processors import Processing
    from ..speculate.sampling import SamplingParams

    if json_schema is not None and regex is not None:
        raise InvalidArgumentError("--json-schema and --regex exclude each other: give one")
    processing = Processing(
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        logit_bias=parse_logit_bias(logit_bias))
    constraint = None
    if json_schema is not None:
        text = _read_schema(json_schema)
        try:
            constraint = Constraint.json_schema(text)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"--json-schema {json_schema}: {e}") from None
    elif regex is not None:
        if not regex:
            raise InvalidArgumentError("--regex is empty")
        constraint = Constraint("regex", regex)
    if constraint is not None:
        try:
            constraint.grammar()  # a schema or regex llguidance cannot compile: now, not later
        except InvalidArgumentError as e:
            flag = f"--json-schema {json_schema}" if json_schema is not None else "--regex"
            raise InvalidArgumentError(f"{flag}: {e}") from None
    return SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, seed=seed, min_p=min_p,
                          processing=processing, constraint=constraint)


def check_logprobs(logprobs: int | None) -> int | None:
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise InvalidArgumentError(
            f"--logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    return logprobs


def sampling_extras(params) -> dict:
    """What a summary or card records beyond the OpenAI fields: only the controls in use."""
    extra = {}
    if params.min_p:
        extra["min_p"] = params.min_p
    p = params.processing
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        if getattr(p, name) is not None:
            extra[name] = getattr(p, name)
    if p.repetition_penalty is not None:
        extra["repetition_context_size"] = p.repetition_context_size
    if p.logit_bias:
        extra["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if params.constraint is not None:
        extra["constraint"] = {"kind": params.constraint.kind, "value": params.constraint.value}
    return extra
