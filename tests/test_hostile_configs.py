"""Hostile inputs, table-driven: a target folder whose config.json, tokenizer_config.json or
chat template is wrong, and sizes from flags past a ceiling or this process's memory. Each
case ends in exit code 2 and one `error:` line naming the file and field (or flag), never a
traceback, a hang or an allocation that aborts."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx import machine, template_probe
from dflash_mlx.cli import app

runner = CliRunner()
NEVER_ENDS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
              "{% endfor %}")
HUGE = ("{% for i in range(100000) %}{% for j in range(100000) %}0123456789{% endfor %}"
        "{% endfor %}")

# (id, file, change, what the line must say). A dict change is merged into the JSON file
# (None deletes a key); a str or bytes change replaces the file.
CONFIGS = [
    ("heads-a-string", "config.json", {"num_attention_heads": "4"},
     "'num_attention_heads' must be an integer, got '4'"),
    ("hidden-a-string", "config.json", {"hidden_size": "64"}, "'hidden_size' must be an integer"),
    ("zero-heads", "config.json", {"num_attention_heads": 0},
     "'num_attention_heads' must be positive, got 0"),
    ("zero-kv-heads", "config.json", {"num_key_value_heads": 0},
     "'num_key_value_heads' must be positive"),
    ("fractional-layers", "config.json", {"num_hidden_layers": 6.5},
     "'num_hidden_layers' must be an integer, got 6.5"),
    ("absurd-layers", "config.json", {"num_hidden_layers": 10**8},
     "'num_hidden_layers' is 100000000, over the limit 1024"),
    ("absurd-vocab", "config.json", {"vocab_size": 10**12}, "'vocab_size' is 1000000000000, over"),
    ("negative-vocab", "config.json", {"vocab_size": -5}, "'vocab_size' must be positive"),
    ("heads-not-dividing-hidden", "config.json",
     {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": None},
     "'hidden_size' 64 is not divisible by 'num_attention_heads' 6"),
    ("heads-not-multiple-of-kv", "config.json", {"num_key_value_heads": 3},
     "'num_attention_heads' 4 is not a multiple of 'num_key_value_heads' 3"),
    ("nan-rope-theta", "config.json", {"rope_theta": math.nan},
     "'rope_theta' must be a finite number"),
    ("eps-above-one", "config.json", {"rms_norm_eps": 2}, "'rms_norm_eps' must be in (0, 1)"),
    ("tie-a-string", "config.json", {"tie_word_embeddings": "yes"},
     "'tie_word_embeddings' must be true or false"),
    ("rope-scaling-a-string", "config.json", {"rope_scaling": "linear"},
     "'rope_scaling' must be an object"),
    ("rope-factor-a-string", "config.json", {"rope_scaling": {"type": "linear", "factor": "2"}},
     "'rope_scaling.factor' must be a number"),
    ("quantization-bits-7", "config.json", {"quantization": {"bits": 7, "group_size": 64}},
     "'quantization.bits' must be one of"),
    ("text-config-hidden-a-string", "config.json", {"text_config": {"hidden_size": "64"}},
     "'text_config.hidden_size' must be an integer"),
    ("model-type-a-number", "config.json", {"model_type": 5}, "'model_type' must be a string"),
    ("config-a-list", "config.json", "[1, 2]", "config.json: expected a JSON object, got list"),
    ("config-not-json", "config.json", "{not json", "config.json: not valid JSON"),
    ("template-a-number", "tokenizer_config.json", {"chat_template": 5},
     "tokenizer_config.json: 'chat_template' must be a string, got 5"),
    ("template-a-bad-list", "tokenizer_config.json", {"chat_template": [{"name": 1}]},
     "'chat_template' must be a string or a list"),
    ("template-too-long", "tokenizer_config.json", {"chat_template": "x" * (2 << 20)},
     "'chat_template' is over the limit of 1048576 characters"),
    ("eos-a-number", "tokenizer_config.json", {"eos_token": 5}, "'eos_token' must be a string"),
    ("max-length-a-string", "tokenizer_config.json", {"model_max_length": "big"},
     "'model_max_length' must be a number"),
    ("added-tokens-a-list", "tokenizer_config.json", {"added_tokens_decoder": [1]},
     "'added_tokens_decoder' must map token ids"),
    ("tokenizer-config-not-json", "tokenizer_config.json", "{",
     "tokenizer_config.json: not valid JSON"),
    ("template-not-utf8", "chat_template.jinja", b"\xff\xfe{{ x }}",
     "chat_template.jinja: cannot read as UTF-8"),
    ("template-never-ends", "chat_template.jinja", NEVER_ENDS,
     "chat_template.jinja: the chat template did not finish rendering"),
    ("template-output-huge", "chat_template.jinja", HUGE,
     "chat_template.jinja: the chat template wrote over 1048576 characters"),
]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _hostile(tiny, tmp_path: Path, file: str, change) -> Path:
    folder = _copy(tiny.target, tmp_path / "target")
    path = folder / file
    if isinstance(change, dict):
        raw = json.loads(path.read_text())
        raw.update(change)
        raw = {k: v for k, v in raw.items() if v is not None}
        path.write_text(json.dumps(raw))
    elif isinstance(change, bytes):
        path.write_bytes(change)
    else:
        path.write_text(change)
    return folder


def _one_error_line(r, expected: str) -> str:
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in r.output and r.stdout == ""
    return lines[0]


@pytest.mark.parametrize("case", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_hostile_target_folder_is_one_line_naming_the_file(case, tiny, tmp_path, monkeypatch,
                                                              isolated_cache):
    _, file, change, expected = case
    monkeypatch.setattr(template_probe, "SECONDS", 0.5)  # the bound, not its default length
    folder = _hostile(tiny, tmp_path, file, change)
    r = runner.invoke(app, ["generate", "hi", "--model", str(folder), "--no-draft",
                            "--max-tokens", "1"])
    line = _one_error_line(r, expected)
    assert str(folder / file) in line  # the file, by its path


def test_the_untouched_copy_loads(tiny, tmp_path, isolated_cache):
    """The cases above fail for their change, not for the copy."""
    folder = _copy(tiny.target, tmp_path / "target")
    r = runner.invoke(app, ["generate", "hi", "--model", str(folder), "--no-draft",
                            "--max-tokens", "1", "--quiet"])
    assert r.exit_code == 0, (r.output, r.exception)


def test_a_template_list_of_named_strings_is_accepted(tiny, tmp_path, isolated_cache):
    folder = _hostile(tiny, tmp_path, "tokenizer_config.json",
                      {"chat_template": [{"name": "default", "template": "{{ x }}"}]})
    r = runner.invoke(app, ["generate", "hi", "--model", str(folder), "--no-draft",
                            "--max-tokens", "1", "--quiet"])
    assert r.exit_code == 0, (r.output, r.exception)


def test_weights_past_this_process_memory_are_refused_before_loading(tiny, monkeypatch,
                                                                    isolated_cache):
    monkeypatch.setattr(machine, "memory_limit_bytes", lambda: 10_000)
    r = runner.invoke(app, ["generate", "hi", "--model", str(tiny.target), "--no-draft",
                            "--max-tokens", "1"])
    line = _one_error_line(r, "loading the target needs about")
    assert "more than the 0 MB of memory this process can hold" in line


def test_out_of_memory_while_loading_is_one_line(tiny, monkeypatch, isolated_cache):
    from dflash_mlx import loader

    def exhausted(*_a, **_k):
        raise MemoryError

    monkeypatch.setattr(loader, "load_target", exhausted)
    r = runner.invoke(app, ["generate", "hi", "--model", str(tiny.target), "--no-draft",
                            "--max-tokens", "1"])
    _one_error_line(r, "out of memory")


# ---------------------------------------------------------------- sizes and numbers from flags

DOCTOR = ["doctor", "--shape", "tiny", "--repeats", "1", "--context", "16", "--seconds", "0"]
FLAGS = [
    ("doctor-seconds-nan", [*DOCTOR, "--seconds", "nan"], "--seconds must be a finite number"),
    ("doctor-seconds-inf", [*DOCTOR, "--seconds", "inf"], "--seconds must be a finite number"),
    ("doctor-seconds-negative", [*DOCTOR, "--seconds", "-1"], "--seconds must be at least 0"),
    ("doctor-seconds-a-year", [*DOCTOR, "--seconds", "31536000"],
     "--seconds must be at most 86400"),
    ("doctor-repeats-absurd", [*DOCTOR, "--repeats", "1000000000"],
     "--repeats must be at most 1000, got 1000000000"),
    ("doctor-repeats-zero", [*DOCTOR, "--repeats", "0"], "--repeats must be at least 1"),
    ("doctor-context-huge", [*DOCTOR, "--context", "100000000000"],
     "--context must be at most 1048576"),
    ("doctor-context-zero", [*DOCTOR, "--context", "0"], "--context must be at least 1"),
    ("doctor-tau-nan", [*DOCTOR, "--tau", "nan"], "--tau is τ at block 5"),
    ("generate-tree-huge", ["generate", "hi", "--model", "{target}", "--draft", "{draft}",
                            "--tree", "100000000"], "--tree': at most 1024 nodes"),
    ("benchmark-repeats-absurd", ["benchmark", "--model", "{target}", "--draft", "{draft}",
                                  "--repeats", "1000000"], "--repeats must be at most 1000"),
    ("serve-max-tokens-huge", ["serve", "--model", "{target}", "--draft", "{draft}",
                               "--max-tokens", "100000000"], "--max-tokens must be at most"),
]


@pytest.mark.parametrize("case", FLAGS, ids=[c[0] for c in FLAGS])
def test_a_size_past_its_ceiling_is_one_line_naming_the_limit(case, tiny, isolated_cache):
    _, args, expected = case
    paths = {k: str(v) for k, v in vars(tiny).items()}
    r = runner.invoke(app, [a.format(**paths) for a in args])
    _one_error_line(r, expected)


def test_doctor_context_at_the_targets_context_is_refused(isolated_cache):
    r = runner.invoke(app, [*DOCTOR, "--context", "2048"])  # the tiny shape's context
    _one_error_line(r, "--context must be below the target's context of 2048 tokens")


def test_doctor_context_past_this_process_memory_is_refused(isolated_cache, monkeypatch):
    monkeypatch.setattr(machine, "memory_limit_bytes", lambda: 50_000_000)
    r = runner.invoke(app, [*DOCTOR, "--context", "2000"])
    _one_error_line(r, "--context 2000 (one prefill of 2000 tokens) needs about")


@pytest.mark.slow
def test_a_never_ending_template_exits_2_as_a_process(tiny, tmp_path):
    """The real entry point: the probe's thread is stopped and the process ends, exit 2."""
    folder = _hostile(tiny, tmp_path, "chat_template.jinja", NEVER_ENDS)
    r = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "generate", "hi", "--model",
                        str(folder), "--no-draft", "--max-tokens", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "did not finish rendering" in lines[0], r.stderr


def test_the_tree_ceiling_holds_for_the_python_api_too():
    from dflash_mlx import SpeculationConfig
    from dflash_mlx.errors import InvalidArgumentError

    assert SpeculationConfig(tree=1024).tree == 1024
    with pytest.raises(InvalidArgumentError, match="--tree must be at most 1024, got 1025"):
        SpeculationConfig(tree=1025)


@pytest.mark.slow
def test_a_low_memory_rlimit_runs_on_mlxs_own_blas(tiny):
    """Under `ulimit -v 1G` OpenBLAS cannot reserve its buffers and would end the process:
    it is not preloaded there, and the tiny target still generates."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    r = subprocess.run([sys.executable, "-m", "dflash_mlx.cli", "generate", "hi", "--model",
                        str(tiny.target), "--no-draft", "--max-tokens", "2", "--quiet"],
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
