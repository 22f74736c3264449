"""Chip profiles are validated when loaded: every field's type and range, one line naming it."""

import json

import pytest

from anelm.cli.main import main
from anelm.chip.profile import ChipProfile, load_profile
from anelm.errors import AnelmError


@pytest.mark.parametrize("field, value, expected", [
    ("compile_budget", -3, "an integer >= 1"),
    ("compile_budget", 0, "an integer >= 1"),
    ("compile_budget", 2.5, "an integer >= 1"),
    ("compile_budget", True, "an integer >= 1"),
    ("min_surface_bytes", "lots", "an integer >= 0"),
    ("min_surface_bytes", -1, "an integer >= 0"),
    ("spatial_multiple_of", 0, "an integer >= 1"),
    ("reject_conv_bias", 1, "true or false"),
    ("sdpa_ignores_mask", "yes", "true or false"),
    ("rejected_ops", "concat", "a list of op names"),
    ("rejected_ops", ["concat", 3], "a list of op names"),
    ("rejected_ops", ["concat", "frobnicate"], "a list of known op names ('frobnicate' not in"),
    ("saturate_above", 0, "a positive number or null"),
    ("saturate_above", "4094", "a positive number or null"),
    ("accumulator_limit", -32768, "a positive number or null"),
    ("accumulator", "int32", 'one of "fp32", "q15.16"'),
    ("compute_dtype", "bf16", 'one of "fp16", "fp32"'),
    ("name", 7, "a string"),
    ("notes", [], "a JSON object"),
])
def test_a_wrong_field_is_one_line_naming_it(tmp_path, field, value, expected):
    path = tmp_path / "chip.json"
    path.write_text(json.dumps({"name": "chip", field: value}))
    with pytest.raises(AnelmError) as e:
        load_profile(str(path))
    msg = str(e.value)
    assert f"field '{field}' must be {expected}" in msg and f"got {json.dumps(value)}" in msg, msg
    assert "\n" not in msg


def test_valid_values_load_and_the_accumulator_fields_default():
    p = ChipProfile.from_dict({"compile_budget": 1, "min_surface_bytes": 0, "rejected_ops": ["concat"],
                               "saturate_above": 4094, "spatial_multiple_of": 16})
    assert (p.compile_budget, p.rejected_ops, p.saturate_above) == (1, ("concat",), 4094)
    for accumulator in ({"accumulator_limit": 32768, "accumulator": "q15.16"},
                        {"accumulator_limit": None, "accumulator": "fp32"}):
        ChipProfile.from_dict(accumulator)  # accepted (and checked) ahead of the emulator's model
    assert load_profile("permissive-test").min_surface_bytes == 0
    with pytest.raises(AnelmError, match=r"unknown chip-profile key\(s\) \['colour'\]"):
        ChipProfile.from_dict({"colour": "blue"})


def test_the_cli_reports_a_bad_profile_before_any_work(tmp_path, capsys):
    path = tmp_path / "chip.json"
    path.write_text(json.dumps({"compile_budget": -1}))
    assert main(["compile", "--profile", str(path), "--out", str(tmp_path / "k")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "anelm: error: " in err and "'compile_budget' must be an integer >= 1" in err
    assert not (tmp_path / "k").exists()
