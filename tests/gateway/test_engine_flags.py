"""The engine flags are generated from EngineConfig: one field, one flag, one help text."""

import argparse
import dataclasses
import typing
from typing import Literal

import pytest

from loraplex.engine.config import EngineConfig
from loraplex.gateway.cli import build_parser
from loraplex.gateway.commands.config_flags import attribute_docs, help_text
from loraplex.gateway.commands.engine_args import (
    CORE_PROCESS_FIELDS,
    FLAG_SPECS,
    NOT_FLAGS,
    config_from_args,
    engine_flag_fields,
)
from loraplex.gateway.commands.serve import serve_engine_config

FIELDS = [f.name for f in dataclasses.fields(EngineConfig)]


def _actions(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices[command]._actions}


def test_every_field_has_a_docstring_and_the_specs_name_real_fields():
    docs = attribute_docs(EngineConfig)
    assert set(docs) == set(FIELDS)
    assert all(len(text) > 10 for text in docs.values())
    assert set(FLAG_SPECS) <= set(FIELDS)
    assert set(NOT_FLAGS) | set(CORE_PROCESS_FIELDS) <= set(FIELDS)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_field_is_a_flag_with_its_docstring_as_help(command):
    actions = _actions(command)
    expected = engine_flag_fields(core_process=command == "serve")
    assert set(expected) == set(FIELDS) - set(NOT_FLAGS) - (
        set() if command == "serve" else set(CORE_PROCESS_FIELDS)
    )
    docs = attribute_docs(EngineConfig)
    for name in expected:
        action = actions[name]
        flag = action.option_strings[0]
        assert flag == (
            FLAG_SPECS[name].flag
            if name in FLAG_SPECS and FLAG_SPECS[name].flag
            else "--" + name.replace("_", "-")
        )
        first_words = " ".join(docs[name].split()[1:4]).replace("``", "")
        assert first_words.split()[0] in action.help, (name, action.help)
        assert action.default == getattr(EngineConfig(model=""), name)
    if command == "generate":
        assert not set(CORE_PROCESS_FIELDS) & set(actions)


def test_no_flags_give_the_default_config():
    args = build_parser().parse_args(["serve"])
    assert config_from_args(args, "m") == EngineConfig(model="m")
    assert serve_engine_config(args, "m") == EngineConfig(model="m")
    gen = build_parser().parse_args(["generate", "--input", "a", "--output", "b"])
    assert config_from_args(gen, "m") == EngineConfig(model="m")


def _other_value(name: str, default):
    """A value other than the default for a field, and how it is written on the command line."""
    hint = typing.get_type_hints(EngineConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if len(args) == 1 and typing.get_origin(hint) is not Literal else hint
    if typing.get_origin(base) is Literal:
        value = next(c for c in typing.get_args(base) if c != default)
        return value, [value]
    if name == "cuda_graph_sizes":
        return (1, 2, 8), ["1,2,8"]
    if name == "cpu_threads_bind":
        return "nobind", ["nobind"]
    if name.endswith("_bytes"):
        return 3 * 1024**3, ["3GiB"]
    if base is bool:
        return (not default), []
    if base is int:
        value = (default or 0) + 3
        return value, [str(value)]
    if base is float:
        value = (default or 0.0) + 0.25
        return value, [str(value)]
    return "elsewhere", ["elsewhere"]


@pytest.mark.parametrize("name", engine_flag_fields(core_process=True))
def test_each_flag_sets_its_field(name):
    default = getattr(EngineConfig(model=""), name)
    value, words = _other_value(name, default)
    action = _actions("serve")[name]
    flag = action.option_strings[0]
    if isinstance(value, bool):
        flag = flag if value else action.option_strings[1]  # --x / --no-x
    args = build_parser().parse_args(["serve", flag, *words])
    assert getattr(args, name) == value


def test_a_whole_command_line_reaches_the_config():
    argv = [
        "serve",
        "--block-size",
        "32",
        "--kv-cache-memory",
        "1GiB",
        "--swap-space",
        "512MiB",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "3",
        "--prompt-lookup-min",
        "3",
        "--prompt-lookup-max",
        "5",
        "--max-images",
        "2",
        "--no-enable-prefix-caching",
        "--engine-unresponsive-timeout",
        "2",
        "--engine-dead-timeout",
        "4",
        "--grammar-memory",
        "0",
        "--grammar-timeout",
        "1.5",
    ]
    config = serve_engine_config(build_parser().parse_args(argv), "m")
    assert config == EngineConfig(
        model="m",
        block_size=32,
        kv_cache_memory_bytes=1024**3,
        swap_space_bytes=512 * 1024**2,
        speculative_method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_min=3,
        prompt_lookup_max=5,
        max_images=2,
        enable_prefix_caching=False,
        unresponsive_timeout_s=2.0,
        dead_timeout_s=4.0,
        grammar_memory_bytes=0,
        grammar_cpu_seconds=1.5,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-cache-memory", "4GB"],  # decimal units are refused, not guessed at
        ["--device", "tpu"],
        ["--block-size", "sixteen"],
    ],
)
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2


def test_core_process_timeouts_are_refused_without_a_core_process():
    args = build_parser().parse_args(
        ["serve", "--no-engine-process", "--engine-unresponsive-timeout", "3"]
    )
    with pytest.raises(ValueError, match="no-engine-process"):
        serve_engine_config(args, "m")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--engine-dead-timeout", "3"])


def test_help_text_names_flags_and_reads_like_the_hand_written_help():
    flags = {"max_num_seqs": "--max-num-seqs"}
    assert help_text("Tokens per ``max_num_seqs`` and ``x``.", flags) == (
        "tokens per --max-num-seqs and x"
    )
    assert help_text("CUDA: share.", flags) == "CUDA: share"
    assert help_text("LoRA adapters.", flags) == "LoRA adapters"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--vision-cache-entries", "-1"], "vision_cache_entries"),
        (["--num-cpu-threads", "0"], "num_cpu_threads"),
        (["--max-images", "-1"], "max_images"),
        (["--batch-yield-s", "-1"], "batch_yield_s"),
        (["--batch-yield-s", "nan"], "batch_yield_s"),
    ],
)
def test_a_new_flag_out_of_range_is_refused_before_the_model_loads(argv, match):
    with pytest.raises(ValueError, match=match):
        config_from_args(build_parser().parse_args(["serve", *argv]), "m")


def test_swap_preemption_with_a_swap_space_smaller_than_a_block_is_refused(tiny_text_dir):
    # Not silently recomputed instead: the operator asked for swap.
    from loraplex.engine.client.llm import LLM

    config = EngineConfig(
        model=tiny_text_dir, num_kv_blocks=64, preemption="swap", swap_space_bytes=1024
    )
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(config)


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("flag", ["--cpu-threads", "--num-cpu-threads"])
def test_cpu_threads_and_its_older_name_set_one_field(command, flag):
    base = [command] if command == "serve" else [command, "--input", "a", "--output", "b"]
    args = build_parser().parse_args([*base, flag, "3"])
    assert config_from_args(args, "m").num_cpu_threads == 3
    assert config_from_args(build_parser().parse_args(base), "m").num_cpu_threads is None


def _one_cpu() -> str:
    from loraplex.engine.core.cpu_bind import allowed_cpus

    return str(min(allowed_cpus()))


def test_cpu_threads_bind_takes_auto_nobind_and_cpu_lists_of_this_machine():
    parse = build_parser().parse_args
    assert config_from_args(parse(["serve"]), "m").cpu_threads_bind == "auto"
    for value in ("auto", "nobind", _one_cpu()):
        args = parse(["serve", "--cpu-threads-bind", value])
        assert config_from_args(args, "m").cpu_threads_bind == value
    cpu = _one_cpu()
    args = parse(["serve", "--cpu-threads-bind", f" {cpu} | {cpu}", "--replicas", "2"])
    assert serve_engine_config(args, "m").cpu_threads_bind == f"{cpu}|{cpu}"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "an empty CPU list"),
        ("0-", "is not a CPU number or a range"),
        ("3-1", "ends below its start"),
        ("0|", "an empty CPU list"),
        ("65535", "are not among the CPUs this process may run on"),
        ("bind", "is not a CPU number or a range"),
    ],
)
def test_a_bad_cpu_threads_bind_is_a_usage_error(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--cpu-threads-bind", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("loraplex serve: error: argument --cpu-threads-bind: "), err
    assert message in err


def test_cpu_lists_must_match_the_replicas_and_bind_processes():
    cpu = _one_cpu()
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="2 CPU lists for 1 engine: give one list per replica"):
        serve_engine_config(parse(["serve", "--cpu-threads-bind", f"{cpu}|{cpu}"]), "m")
    with pytest.raises(ValueError, match="1 CPU list for 2 engine replicas"):
        serve_engine_config(parse(["serve", "--cpu-threads-bind", cpu, "--replicas", "2"]), "m")
    argv = ["serve", "--cpu-threads-bind", f"{cpu}|{cpu}", "--replicas", "2"]
    with pytest.raises(ValueError, match="--replicas and --no-engine-process"):
        serve_engine_config(parse([*argv, "--no-engine-process"]), "m")
    with pytest.raises(ValueError, match="with --ray-address"):
        serve_engine_config(parse([*argv, "--ray-address", "auto"]), "m")
    # auto and nobind fit any set of engines
    for value in ("auto", "nobind"):
        args = parse(["serve", "--cpu-threads-bind", value, "--replicas", "3"])
        assert serve_engine_config(args, "m").cpu_threads_bind == value


def test_kv_offloading_size_takes_vllms_bare_gib_or_a_size():
    for words, expected in (
        (["8"], 8 * 1024**3),
        (["0.5"], 512 * 1024**2),
        (["256MiB"], 256 << 20),
    ):
        args = build_parser().parse_args(["serve", "--kv-offloading-size", *words])
        assert args.kv_offloading_bytes == expected
    for bad in ("-1", "8GB"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--kv-offloading-size", bad])
