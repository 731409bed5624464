"""Every option is type-checked: booleans take only bools, dynamic_ops names must name an
operator, an empty CGBACKEND_CAPTURE_SIZES is an error ("off" turns bucketing off)."""

from __future__ import annotations

import pytest
import torch

import cgbackend
from cgbackend import Config, ConfigError

BOOL_OPTIONS = ("capture", "strict", "opaque_modules", "simulate_graphs")


@pytest.mark.parametrize("name", BOOL_OPTIONS)
@pytest.mark.parametrize("value", ["no", "false", "False", "0", "", 0, 1, None, 1.0])
def test_boolean_options_take_only_bools(name, value):
    with pytest.raises(ConfigError, match=name):
        Config(**{name: value})
    with pytest.raises(ConfigError, match=name):
        cgbackend.backend(**{name: value})


def test_string_false_does_not_simulate_or_skip_capture():
    # A string is not a bool: simulate_graphs="no" must not be kept as a (truthy) string that simulates replays.
    with pytest.raises(ConfigError, match="simulate_graphs"):
        cgbackend.compile(torch.nn.Linear(2, 2), simulate_graphs="no")
    with pytest.raises(ConfigError, match="capture"):
        cgbackend.compile(torch.nn.Linear(2, 2), capture="false")
    with pytest.raises(ConfigError, match="strict"):
        cgbackend.backend(strict=1)


@pytest.mark.parametrize("name", BOOL_OPTIONS)
def test_boolean_options_take_bools_and_the_environment_spellings(name):
    for value in (True, False):
        assert getattr(Config(**{name: value}), name) is value
    for text, value in (("1", True), ("yes", True), ("On", True), ("0", False), ("false", False), ("no", False)):
        cfg = Config.from_options({}, environ={"CGBACKEND_" + name.upper(): text})
        assert getattr(cfg, name) is value


@pytest.mark.parametrize("bad", ["no::such_op", "torch.no_such_op", "Tensor.no_such_method", "nonzero",
                                 "torch.nn.functional.no_such", "no_such_module.fn"])
def test_dynamic_ops_names_must_resolve(bad):
    with pytest.raises(ConfigError) as info:
        Config(dynamic_ops=("torch.nonzero", bad))
    assert repr(bad) in str(info.value) and "torch.nonzero" not in str(info.value).split("names no")[0]
    with pytest.raises(ConfigError, match="no operator"):
        Config.from_options({}, environ={"CGBACKEND_DYNAMIC_OPS": bad})


@pytest.mark.parametrize("good", ["torch.nonzero", "Tensor.item", "aten::nonzero", "aten::nonzero.default",
                                  "torch.nn.functional.linear", "operator.getitem"])
def test_dynamic_ops_names_that_resolve_are_accepted(good):
    assert Config(dynamic_ops=(good,)).dynamic_ops == (good,)


def test_dynamic_ops_accepts_a_registered_custom_op():
    @torch.library.custom_op("cgtest_config::scale", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    assert Config(dynamic_ops=("cgtest_config::scale",)).dynamic_ops == ("cgtest_config::scale",)
    with pytest.raises(ConfigError, match="cgtest_config::scal'"):
        Config(dynamic_ops=("cgtest_config::scal",))


@pytest.mark.parametrize("raw", ["", "  "])
def test_empty_capture_sizes_variable_is_an_error(raw):
    with pytest.raises(ConfigError, match="CGBACKEND_CAPTURE_SIZES.*off"):
        Config.from_options({}, environ={"CGBACKEND_CAPTURE_SIZES": raw})


def test_capture_sizes_off_turns_bucketing_off():
    for raw in ("off", "OFF", "none"):
        assert Config.from_options({}, environ={"CGBACKEND_CAPTURE_SIZES": raw}).capture_sizes == ()
    assert Config(capture_sizes=()).capture_sizes == ()
    assert Config.from_options({}, environ={"CGBACKEND_CAPTURE_SIZES": "4,2"}).capture_sizes == (2, 4)
