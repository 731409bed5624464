"""cgbackend.Config: defaults, CGBACKEND_* environment overrides, validation, immutability."""

from __future__ import annotations

import dataclasses
import json

import re

import pytest
import torch

import cgbackend
from cgbackend import Config, ConfigError

FIELDS = ("warmup", "capture", "min_region_ops", "max_graphs_per_region", "max_pending_forwards", "strict",
          "inner", "dynamic_ops", "dynamic_modules", "opaque_modules", "simulate_graphs")

DEFAULTS = dict(warmup=3, capture=True, min_region_ops=2, max_graphs_per_region=32, graph_cache="lru",
                max_pending_forwards=4, strict=False, inner="auto", dynamic_ops=(), dynamic_modules=(),
                opaque_modules=True, simulate_graphs=False)


def test_field_names_include_the_documented_options():
    assert set(FIELDS) <= set(Config.field_names())
    assert Config.field_names() == tuple(f.name for f in dataclasses.fields(Config))


def test_defaults():
    cfg = Config()
    for name, value in DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    assert isinstance(cfg.dynamic_ops, tuple) and isinstance(cfg.dynamic_modules, tuple)


def test_from_options_without_environment_is_the_defaults():
    assert Config.from_options(None, environ={}) == Config()
    assert Config.from_options({}, environ={}) == Config()


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# ----------------------------------------------------------------------------- unknown options

def _check_lists_valid_options(message: str, unknown: str) -> None:
    assert unknown in message
    for name in Config.field_names():
        assert name in message, f"{name} missing from {message!r}"


@pytest.mark.parametrize("make", [
    pytest.param(lambda: Config.from_options({"bogus": 1}, environ={}), id="Config.from_options"),
    pytest.param(lambda: cgbackend.backend(bogus=1), id="cgbackend.backend"),
    pytest.param(lambda: cgbackend.CGBackend(bogus=1), id="CGBackend"),
    pytest.param(lambda: Config().replace(bogus=1), id="Config.replace"),
    pytest.param(lambda: cgbackend.compile(torch.nn.Linear(2, 2), bogus=1), id="cgbackend.compile"),
    pytest.param(lambda: cgbackend.explain(torch.nn.Linear(2, 2), torch.randn(1, 2), options={"bogus": 1}),
                 id="cgbackend.explain"),
])
def test_unknown_option_rejected_with_the_valid_ones(make):
    with pytest.raises(ConfigError) as info:
        make()
    _check_lists_valid_options(str(info.value), "bogus")


@pytest.mark.parametrize("options, suggestion", [
    ({"warmpu": 2}, "did you mean 'warmup'?"),
    ({"static_dispatch": "autp"}, "did you mean 'auto'?"),
    ({"inner": "inductr"}, "did you mean 'inductor'?"),
    ({"graph_cache": "lur"}, "did you mean 'lru'?"),
])
def test_a_typo_suggests_the_closest_valid_one(options, suggestion):
    with pytest.raises(ConfigError, match=re.escape(suggestion)):
        Config.from_options(options, environ={})


def test_a_command_line_typo_suggests_the_closest_option():
    from cgbackend.cli import CLIError, _parse_options
    with pytest.raises(CLIError, match=re.escape("unknown option 'static_dispach' (did you mean 'static_dispatch'?)")):
        _parse_options(["static_dispach=auto"])


@pytest.mark.parametrize("make", [
    pytest.param(lambda: cgbackend.compile(torch.nn.Linear(2, 2), mode="reduce-overhead"), id="cgbackend.compile"),
    pytest.param(lambda: cgbackend.backend(mode="max-autotune"), id="cgbackend.backend"),
    pytest.param(lambda: Config.from_options({"mode": "reduce-overhead"}, environ={}), id="Config"),
])
def test_torch_compiles_mode_gets_the_message_it_gets_by_name(make):
    """mode= is torch.compile's: wherever cgbackend options go, the same tailored message as by name,
    not a bare "unknown option"."""
    with pytest.raises(ConfigError) as info:
        make()
    text = str(info.value)
    assert "mode=" in text and "Inductor" in text and "cgbackend.compile(model, warmup=3)" in text
    assert "unknown" not in text


def test_options_given_as_a_dict_say_keywords():
    with pytest.raises(ConfigError, match="take them as keywords"):
        cgbackend.compile(torch.nn.Linear(2, 2), options={"warmup": 3})


@pytest.mark.parametrize("entry", [cgbackend.compile, cgbackend.explain])
def test_something_not_callable_is_a_type_error_naming_it(entry):
    with pytest.raises(TypeError, match=r"takes an nn.Module or a function to compile, got str: 'model.py'"):
        entry("model.py")


def test_several_unknown_options_are_all_named():
    with pytest.raises(ConfigError) as info:
        Config.from_options({"bogus": 1, "warmpu": 2, "warmup": 1}, environ={})
    assert "bogus" in str(info.value) and "warmpu" in str(info.value)


# ----------------------------------------------------------------------------- environment

@pytest.mark.parametrize("env, field, expected", [
    ({"CGBACKEND_WARMUP": "5"}, "warmup", 5),
    ({"CGBACKEND_WARMUP": " 0 "}, "warmup", 0),
    ({"CGBACKEND_MIN_REGION_OPS": "7"}, "min_region_ops", 7),
    ({"CGBACKEND_MAX_GRAPHS_PER_REGION": "2"}, "max_graphs_per_region", 2),
    ({"CGBACKEND_MAX_PENDING_FORWARDS": "1"}, "max_pending_forwards", 1),
    ({"CGBACKEND_CAPTURE": "0"}, "capture", False),
    ({"CGBACKEND_CAPTURE": "false"}, "capture", False),
    ({"CGBACKEND_CAPTURE": "Off"}, "capture", False),
    ({"CGBACKEND_CAPTURE": "no"}, "capture", False),
    ({"CGBACKEND_STRICT": "1"}, "strict", True),
    ({"CGBACKEND_STRICT": "TRUE"}, "strict", True),
    ({"CGBACKEND_STRICT": "yes"}, "strict", True),
    ({"CGBACKEND_SIMULATE_GRAPHS": "on"}, "simulate_graphs", True),
    ({"CGBACKEND_INNER": "inductor"}, "inner", "inductor"),
    ({"CGBACKEND_DYNAMIC_OPS": "torch.nonzero, Tensor.item"}, "dynamic_ops", ("torch.nonzero", "Tensor.item")),
    ({"CGBACKEND_DYNAMIC_OPS": "aten::nonzero"}, "dynamic_ops", ("aten::nonzero",)),
    ({"CGBACKEND_DYNAMIC_OPS": ""}, "dynamic_ops", ()),
    ({"CGBACKEND_DYNAMIC_MODULES": "layers.*.moe*,lm_head"}, "dynamic_modules", ("layers.*.moe*", "lm_head")),
])
def test_environment_overrides(env, field, expected):
    cfg = Config.from_options({}, environ=env)
    assert getattr(cfg, field) == expected
    assert type(getattr(cfg, field)) is type(expected)
    # Every other field keeps its default.
    for name, value in DEFAULTS.items():
        if name != field:
            assert getattr(cfg, name) == value, name


def test_unrelated_environment_variables_are_ignored():
    env = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0", "TORCHDYNAMO_VERBOSE": "1", "XCGBACKEND_WARMUP": "9"}
    assert Config.from_options({}, environ=env) == Config()


@pytest.mark.parametrize("env, mentions", [
    ({"CGBACKEND_WARMUP": "abc"}, "CGBACKEND_WARMUP"),
    ({"CGBACKEND_WARMUP": "1.5"}, "CGBACKEND_WARMUP"),
    ({"CGBACKEND_WARMUP": "-1"}, "warmup"),
    ({"CGBACKEND_MIN_REGION_OPS": "0"}, "min_region_ops"),
    ({"CGBACKEND_CAPTURE": "maybe"}, "CGBACKEND_CAPTURE"),
    ({"CGBACKEND_STRICT": "2"}, "CGBACKEND_STRICT"),
    ({"CGBACKEND_INNER": "x"}, "inner"),
    ({"CGBACKEND_NOSUCH": "1"}, "CGBACKEND_NOSUCH"),
])
def test_bad_environment_values_rejected(env, mentions):
    with pytest.raises(ConfigError) as info:
        Config.from_options({}, environ=env)
    assert mentions in str(info.value)


def test_unknown_environment_variable_lists_the_valid_ones():
    with pytest.raises(ConfigError) as info:
        Config.from_options({}, environ={"CGBACKEND_WARMUPS": "1"})
    for name in Config.field_names():
        assert "CGBACKEND_" + name.upper() in str(info.value)


def test_explicit_options_override_environment():
    env = {"CGBACKEND_WARMUP": "9", "CGBACKEND_STRICT": "1", "CGBACKEND_DYNAMIC_OPS": "torch.nonzero"}
    cfg = Config.from_options({"warmup": 1, "dynamic_ops": ("Tensor.item",)}, environ=env)
    assert cfg.warmup == 1
    assert cfg.dynamic_ops == ("Tensor.item",)
    assert cfg.strict is True  # not overridden: the environment still applies


def test_explicit_option_does_not_rescue_a_bad_environment_value():
    # The environment is read as a whole; a malformed variable is an error even if the option is given.
    with pytest.raises(ConfigError):
        Config.from_options({"warmup": 1}, environ={"CGBACKEND_WARMUP": "abc"})


def test_backend_reads_os_environ(monkeypatch):
    monkeypatch.setenv("CGBACKEND_WARMUP", "6")
    monkeypatch.setenv("CGBACKEND_DYNAMIC_MODULES", "layers.1*")
    assert cgbackend.backend().config.warmup == 6
    assert cgbackend.backend().config.dynamic_modules == ("layers.1*",)
    assert cgbackend.backend(warmup=2).config.warmup == 2


def test_backend_rejects_bad_os_environ(monkeypatch):
    monkeypatch.setenv("CGBACKEND_WARMUP", "many")
    with pytest.raises(ConfigError):
        cgbackend.backend()


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("options, field", [
    ({"warmup": -1}, "warmup"),
    ({"warmup": True}, "warmup"),
    ({"warmup": 1.5}, "warmup"),
    ({"warmup": "3"}, "warmup"),
    ({"min_region_ops": 0}, "min_region_ops"),
    ({"max_graphs_per_region": 0}, "max_graphs_per_region"),
    ({"max_pending_forwards": 0}, "max_pending_forwards"),
    ({"inner": "x"}, "inner"),
    ({"inner": "cudagraphs"}, "inner"),
    ({"dynamic_ops": "torch.nonzero"}, "dynamic_ops"),
    ({"dynamic_ops": (1,)}, "dynamic_ops"),
    ({"dynamic_modules": "layers.*"}, "dynamic_modules"),
])
def test_invalid_values_rejected(options, field):
    with pytest.raises(ConfigError) as info:
        Config(**options)
    assert field in str(info.value)
    with pytest.raises(ConfigError):
        Config.from_options(options, environ={})
    with pytest.raises(ConfigError):
        cgbackend.backend(**options)


def test_inner_error_names_the_choices():
    with pytest.raises(ConfigError) as info:
        Config(inner="x")
    assert "eager" in str(info.value) and "inductor" in str(info.value)


@pytest.mark.parametrize("options", [
    {"warmup": 0}, {"min_region_ops": 1}, {"inner": "inductor"}, {"dynamic_ops": ["torch.nonzero"]},
    {"dynamic_modules": ("layers.*",)}, {"strict": True, "capture": False},
])
def test_boundary_values_accepted(options):
    cfg = Config.from_options(options, environ={})
    for name, value in options.items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(cfg, name) == expected


def test_sequences_become_tuples():
    cfg = Config(dynamic_ops=["torch.nonzero", "Tensor.item"], dynamic_modules=["a.*"])
    assert cfg.dynamic_ops == ("torch.nonzero", "Tensor.item")
    assert cfg.dynamic_modules == ("a.*",)
    assert hash(cfg) == hash(Config(dynamic_ops=("torch.nonzero", "Tensor.item"), dynamic_modules=("a.*",)))


# ----------------------------------------------------------------------------- immutability

@pytest.mark.parametrize("field, value", [("warmup", 5), ("inner", "inductor"), ("dynamic_ops", ("x",))])
def test_frozen(field, value):
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, value)
    assert getattr(cfg, field) == DEFAULTS[field]


def test_backend_config_is_frozen():
    instance = cgbackend.backend(warmup=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        instance.config.warmup = 2
    assert instance.config.warmup == 1


def test_replace_makes_a_new_validated_config(monkeypatch):
    monkeypatch.setenv("CGBACKEND_WARMUP", "9")
    cfg = Config(warmup=1)
    other = cfg.replace(strict=True)
    assert other is not cfg
    assert (cfg.strict, other.strict) == (False, True)
    assert other.warmup == 1  # replace does not re-read the environment
    with pytest.raises(ConfigError):
        cfg.replace(warmup=-1)


def test_to_dict_is_json_ready():
    cfg = Config(dynamic_ops=("torch.nonzero",), warmup=0)
    d = cfg.to_dict()
    assert d["dynamic_ops"] == ["torch.nonzero"]
    assert d["warmup"] == 0
    assert set(d) == set(Config.field_names())
    assert json.loads(json.dumps(d)) == d
    assert Config.from_options(d, environ={}) == cfg


def test_backend_takes_config_or_options_not_both():
    with pytest.raises(TypeError):
        cgbackend.CGBackend(config=Config(), warmup=1)
    cfg = Config(warmup=0)
    assert cgbackend.CGBackend(config=cfg).config is cfg


def test_capture_sizes_default_ladder_and_parsing():
    sizes = Config().capture_sizes
    assert sizes[0] == 1 and list(sizes) == sorted(set(sizes)) and 64 in sizes
    assert Config(capture_sizes=[8, 2, 2, 4]).capture_sizes == (2, 4, 8)
    assert Config.from_options(environ={"CGBACKEND_CAPTURE_SIZES": "16, 4,8"}).capture_sizes == (4, 8, 16)
    assert Config.from_options(environ={"CGBACKEND_CAPTURE_SIZES": "off"}).capture_sizes == ()
    assert Config.from_options(environ={"CGBACKEND_CAPTURE_SIZES": " None "}).capture_sizes == ()
    for bad in ([0, 4], [2.5], ["x"], 8, [True]):
        with pytest.raises(ConfigError, match="capture_sizes"):
            Config(capture_sizes=bad)


def test_graph_cache_choices():
    assert Config(graph_cache="keep").graph_cache == "keep"
    with pytest.raises(ConfigError, match="graph_cache"):
        Config(graph_cache="fifo")
