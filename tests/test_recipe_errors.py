"""The broken-recipe table: each case exits 2 with its one-line message and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_mopt, write_files

MODEL = """\
schema = 1

[models.toy]
family = "toyfam"
source = { path = "toy-model" }
"""

CASES: list[tuple[str, dict[str, str], str]] = [
    (
        "toml_syntax_error_has_line_and_column",
        {"r.toml": MODEL + "\n[toy.cpu\ntargets = []\n"},
        "r.toml:7: TOML syntax error at column 9: expected ']' at the end of a table declaration",
    ),
    (
        "missing_schema",
        {"r.toml": MODEL.replace("schema = 1\n", "")},
        "r.toml: schema: missing `schema = 1` (add it at the top)",
    ),
    (
        "wrong_type",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "toy-export"]\n'
         '[toy.cpu.toy-export]\nopset = "seventeen"\n'},
        "r.toml:9: [toy.cpu.toy-export] opset: input should be a valid integer, got 'seventeen'",
    ),
    # params are strict (pydantic's strict mode): no string, number or bool is coerced into
    # another type; only an int where a float is expected is taken
    *[
        (
            f"coerced_{name}",
            {"r.toml": MODEL + f'[toy.cpu]\ntargets = ["toy-weights", "toy-export"]\n[toy.cpu.toy-export]\n{line}\n'},
            f"r.toml:9: [toy.cpu.toy-export] {message}",
        )
        for name, line, message in [
            ("yes", 'fail = "yes"', "fail: input should be a valid boolean, got 'yes' (fail after writing a partial output)"),
            ("off", 'fail = "off"', "fail: input should be a valid boolean, got 'off' (fail after writing a partial output)"),
            ("zero_bool", "fail = 0", "fail: input should be a valid boolean, got 0 (fail after writing a partial output)"),
            ("float_string", 'sleep = "0.3"', "sleep: input should be a valid number, got '0.3' (seconds to sleep (tests of concurrency))"),
            ("int_string", 'opset = "17"', "opset: input should be a valid integer, got '17'"),
            ("float_int", "opset = 17.0", "opset: input should be a valid integer, got 17.0"),
        ]
    ],
    (
        "coerced_source_param",
        {"r.toml": MODEL.replace('{ path = "toy-model" }', '{ toygen = "x", seed = "0" }') + '[toy.cpu]\ntargets = ["toy-weights"]\n'},
        "r.toml:5: [models.toy.source] seed: input should be a valid integer, got '0'",
    ),
    (
        "unknown_key_in_target_table",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights"]\n[toy.cpu.toy-weights]\ndtpye = "fp16"\n'},
        "r.toml:9: [toy.cpu.toy-weights] dtpye: unknown key (did you mean 'dtype'?)",
    ),
    (
        "unknown_section_level_key",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "toy-export"]\nopst = 3\n'},
        "r.toml:8: [toy.cpu] opst: unknown key (did you mean 'opset'?; a section-level key is a "
        "param shared by the section's targets)",
    ),
    (
        "unknown_target_kind_in_targets",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "toy-exprt"]\n'},
        "r.toml:7: [toy.cpu] targets: unknown target kind 'toy-exprt' (did you mean 'toy-export'?; "
        "a named target needs a table [toy.cpu.toy-exprt] with `kind`)",
    ),
    (
        "unknown_kind_of_named_target",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "x"]\n[toy.cpu.x]\nkind = "toy-enigne"\n'},
        "r.toml:9: [toy.cpu.x] kind: unknown target kind 'toy-enigne' (did you mean 'toy-engine'?; "
        "see `mopt plugins`)",
    ),
    (
        "unknown_model",
        {"r.toml": MODEL + '[toi.cpu]\ntargets = ["toy-weights"]\n'},
        "r.toml:6: [toi] unknown model 'toi' (did you mean 'toy'?; declare it under [models])",
    ),
    (
        "unknown_hardware_from_section_key",
        {"r.toml": MODEL + '[toy.rtx4600]\ntargets = ["toy-weights"]\n'},
        "r.toml:6: [toy.rtx4600] unknown hardware profile 'rtx4600', taken from the section key as "
        "`hardware` is not set (did you mean 'rtx4090'?; see `mopt hardware`)",
    ),
    (
        "unknown_hardware_key",
        {"r.toml": MODEL + '[toy.gpu]\nhardware = "h2000"\ntargets = ["toy-weights"]\n'},
        "r.toml:7: [toy.gpu] hardware: unknown hardware profile 'h2000' (did you mean 'h200'?; "
        "see `mopt hardware`)",
    ),
    (
        "reserved_name_as_model",
        {"r.toml": MODEL + '[models.defaults]\nfamily = "toyfam"\nsource = { path = "toy-model" }\n'},
        "r.toml:6: [models.defaults] 'defaults' is a reserved name and cannot be a model "
        "(reserved: schema, extends, models, defaults; rename the model)",
    ),
    (
        "missing_extended_file",
        {"r.toml": 'extends = ["nope.toml"]\n' + MODEL},
        "r.toml:1: extends: extended file 'nope.toml' not found (looked at nope.toml) "
        "(paths are relative to the file that declares them)",
    ),
    (
        "extends_cycle",
        {
            "r.toml": 'extends = ["sub/a.toml"]\n' + MODEL,
            "sub/a.toml": 'extends = ["../b.toml"]\n',
            "b.toml": 'extends = ["sub/a.toml"]\n',
        },
        "b.toml: extends: extends cycle: sub/a.toml → b.toml → sub/a.toml",
    ),
    (
        "dependency_cycle",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["a", "b"]\n'
         '[toy.cpu.a]\nkind = "command"\nargv = ["true"]\ninput = "b"\n'
         '[toy.cpu.b]\nkind = "command"\nargv = ["true"]\ninput = "a"\n'},
        "r.toml:11: [toy.cpu.a] input: dependency cycle: a → b → a (an `input` points back at a "
        "target that depends on this one)",
    ),
    (
        "unknown_family",
        {"r.toml": MODEL.replace('"toyfam"', '"toyfm"')},
        "r.toml:4: [models.toy] family: unknown model family 'toyfm' (did you mean 'toyfam'?; "
        "families come from plugins (`mopt plugins`))",
    ),
    (
        "unknown_source_kind",
        {"r.toml": MODEL.replace("{ path =", "{ pth =")},
        "r.toml:5: [models.toy] source: a source names exactly one source kind, got pth (did you mean 'path'?)",
    ),
    (
        "misspelled_model_key",
        {"r.toml": MODEL.replace("source =", "soruce =")},
        "r.toml:5: [models.toy] soruce: unknown key (did you mean 'source'?)",
    ),
    (
        "sweep_over_unknown_target",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "toy-export", "toy-engine"]\n'
         '[toy.cpu.sweep]\n"toy-engin.max_batch_size" = [1, 2]\n'},
        "r.toml:9: [toy.cpu.sweep] toy-engin.max_batch_size: sweep over 'toy-engin', which is not "
        "a target of this section (did you mean 'toy-engine'?)",
    ),
    (
        "sweep_value_out_of_range",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "toy-export", "toy-engine"]\n'
         '[toy.cpu.sweep]\n"toy-engine.max_batch_size" = [1, 0]\n'},
        "r.toml:9: [toy.cpu.sweep] toy-engine.max_batch_size: input should be greater than or "
        "equal to 1, got 0",
    ),
    (
        "missing_input_target",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-export"]\n'},
        "r.toml:6: [toy.cpu] targets: target 'toy-export' (toy-export) needs an input of kind "
        "toy-weights, and the section has none (add 'toy-weights' to targets)",
    ),
    (
        "ambiguous_input",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "w2", "toy-export"]\n'
         '[toy.cpu.w2]\nkind = "toy-weights"\n'},
        "r.toml:6: [toy.cpu.toy-export] input: target 'toy-export' could take its 'model' input "
        "from 'toy-weights' or 'w2' (say which: input = \"toy-weights\")",
    ),
    (
        "input_of_wrong_kind",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights", "toy-export", "e2"]\n'
         '[toy.cpu.e2]\nkind = "toy-export"\ninput = "toy-export"\n'},
        "r.toml:10: [toy.cpu.e2] input: input 'toy-export' is a 'toy-export', which kind "
        "'toy-export' does not take (it takes: kind toy-weights)",
    ),
    (
        "target_table_not_listed",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights"]\n[toy.cpu.toy-export]\nopset = 3\n'},
        "r.toml:8: [toy.cpu] toy-export: table 'toy-export' is not a target of this section "
        "(add \"toy-export\" to `targets`)",
    ),
    (
        "no_targets",
        {"r.toml": MODEL + "[toy.cpu]\n"},
        "r.toml:6: [toy.cpu] no `targets` for this section (add targets = [\"weights\", \"onnx\", ...] "
        "here or in [defaults])",
    ),
    (
        "section_key_in_defaults",
        {"r.toml": MODEL + '[defaults]\nhardware = "cpu"\n[toy.cpu]\ntargets = ["toy-weights"]\n'},
        "r.toml:7: [defaults] hardware: 'hardware' belongs in a build section, not in [defaults]",
    ),
    (
        "scalar_at_top_level",
        {"r.toml": "nonsense = 3\n" + MODEL},
        "r.toml:1: nonsense: unknown top-level key (valid top-level keys: defaults, extends, models, "
        "schema; build sections are tables: [<model>.<hardware>])",
    ),
    (
        "unsupported_schema",
        {"r.toml": MODEL.replace("schema = 1", "schema = 7")},
        "r.toml:1: schema: unsupported schema 7 (this mopt reads schema = 1)",
    ),
    (
        "bad_command_env_name",
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["c"]\n[toy.cpu.c]\nkind = "command"\n'
         'argv = ["true"]\nenv = ["NOT-A-NAME"]\n'},
        "r.toml:11: [toy.cpu.c] env: value error, 'NOT-A-NAME' is not an environment variable name, "
        "got ['NOT-A-NAME'] (env variables passed through (keyed))",
    ),
    (
        "toml_date_as_a_param",  # a TOML date is a value like any other, not a crash
        {"r.toml": MODEL + '[toy.cpu]\ntargets = ["c"]\n[toy.cpu.c]\nkind = "command"\nargv = 1979-05-27\n'},
        "r.toml:10: [toy.cpu.c] argv: input should be a valid array, got '1979-05-27' (the command and its arguments)",
    ),
]


@pytest.mark.parametrize(("files", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_broken_recipe_exits_2_with_one_line_message(tmp_path: Path, files: dict[str, str],
                                                     expected: str) -> None:
    (tmp_path / "toy-model").mkdir()
    (tmp_path / "toy-model" / "config.json").write_text("{}")
    write_files(tmp_path, files)
    proc = run_mopt("plan", "r.toml", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: {expected}"]


def test_missing_recipe_file(tmp_path: Path) -> None:
    proc = run_mopt("plan", "nope.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: nope.toml: recipe not found (give the path to a .toml recipe)"


def test_unknown_selector_names_closest(tmp_path: Path) -> None:
    (tmp_path / "toy-model").mkdir()
    write_files(tmp_path, {"r.toml": MODEL + '[toy.cpu]\ntargets = ["toy-weights"]\n'})
    proc = run_mopt("plan", "r.toml", "toy.cpu:toy-wieghts", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: selector 'toy.cpu:toy-wieghts' matches no target (did you mean 'toy-weights'?; "
        "selectors look like model.hardware:target, globs allowed)"
    )
