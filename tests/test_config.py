"""Tests for fedlase.config: the system-string parser, validation of every key, overrides and YAML files."""
import dataclasses

import pytest

from fedlase.config import (CHOICES, Config, config_from_dict, describe_keys, load_config, parse_override,
                            parse_participation, parse_system)
from fedlase.errors import ConfigError, UserError

KEYS = [f.name for f in dataclasses.fields(Config) if not f.metadata.get("derived")]


# --------------------------------------------------------------------------- system strings

@pytest.mark.parametrize("text, expected", [
    ("{1,1/4,1/16,1/64}_{10,20,30,40}", [(1.0, 10), (0.25, 20), (0.0625, 30), (0.015625, 40)]),
    ("{1}_{100}", [(1.0, 100)]),
    ("{0.5,0.25}_{3,7}", [(0.5, 3), (0.25, 7)]),
    ("{ 1 , 1/4 } _ { 10 , 20 }", [(1.0, 10), (0.25, 20)]),
    ("{1/4,1}_{5,1}", [(0.25, 5), (1.0, 1)]),          # order is kept as written
    ("{1e-1}_{2}", [(0.1, 2)]),
])
def test_parse_system_good(text, expected):
    # Execute
    got = parse_system(text)
    # Assert
    assert got == expected
    assert all(isinstance(n, int) for _, n in got)


@pytest.mark.parametrize("text", [
    "1,1/4_10,20",               # no braces
    "{1,1/4}{10,20}",            # no underscore
    "{1,1/4}_{10,20}_{1,2}",     # three groups
    "",                          # empty
    "{}_{}",                     # empty groups
    "{a,1/4}_{10,20}",           # level not a number
    "{1/0}_{10}",                # division by zero
    "{0}_{10}",                  # level 0
    "{1.5}_{10}",                # level above 1
    "{-1/4}_{10}",               # negative level
    "{1,2/1}_{1,1}",
    "{1}_{0}",                   # count 0
    "{1}_{-3}",                  # negative count
    "{1}_{2.5}",                 # fractional count
    "{1}_{x}",
    "{1,1/4}_{10}",              # mismatched lengths
    "{1}_{10,20}",
    "{1,1}_{10,20}",             # duplicate level
    "{1/4,0.25}_{10,20}",        # duplicate level written two ways
])
def test_parse_system_bad(text):
    # Execute / Assert
    with pytest.raises(ConfigError) as e:
        parse_system(text)
    assert e.value.key == "system"
    assert str(e.value).startswith("system:")


# --------------------------------------------------------------------------- participation

@pytest.mark.parametrize("value, expected", [
    (0.1, [0.1]), (1, [1.0]), ("0.1", [0.1]), ("{0.1,0.15,0.2}", [0.1, 0.15, 0.2]), ("{1/10, 1/5}", [0.1, 0.2]),
    ([0.1, 0.2], [0.1, 0.2]), ("[0.1,0.2]", [0.1, 0.2]), ("1e-1", [0.1]),
    ({0.1: None, 0.2: None}, [0.1, 0.2]),   # what YAML makes of an unquoted {0.1, 0.2} in a config file
])
def test_parse_participation_good(value, expected):
    assert parse_participation(value) == pytest.approx(expected)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, "2", "{0.1,1.5}", "{0,0.1}", "{}", "abc", "{0.1,x}", [],
                                   True, {"a": 1}])
def test_parse_participation_bad(value):
    with pytest.raises(ConfigError) as e:
        parse_participation(value)
    assert e.value.key == "participation"


# --------------------------------------------------------------------------- validation

def test_defaults_validate():
    # Execute
    cfg = config_from_dict({})
    # Assert: the paper's system, and derived fields filled
    assert cfg.levels == [(1.0, 10), (0.25, 20), (0.0625, 30), (0.015625, 40)]
    assert cfg.num_clients == 100
    assert cfg.client_levels[:10] == [1.0] * 10 and cfg.client_levels[10] == 0.25 and cfg.client_levels[-1] == 1 / 64
    assert cfg.participation == [0.1]
    assert "levels" not in cfg.to_dict() and set(cfg.to_dict()) == set(KEYS)


BAD = [
    # (override, key the error must name)
    ("foo=1", "foo"),
    ("levels=[1]", "levels"),                         # a derived field is not a key
    ("system={1,2}_{3,4}", "system"),
    ("system={1/4}_{0}", "system"),
    ("system={0}_{5}", "system"),
    ("alpha=0", "alpha"),
    ("alpha=-1", "alpha"),
    ("partition=pathological classes_per_client=11", "classes_per_client"),
    ("partition=pathological classes_per_client=0", "classes_per_client"),
    ("dataset=cifar100 partition=pathological classes_per_client=101 data_dir=/tmp", "classes_per_client"),
    ("participation=0", "participation"),
    ("participation=1.01", "participation"),
    ("participation={0.1,0.15,2}", "participation"),
    ("participation={}", "participation"),
    ("data_dir=/no/such/folder/anywhere", "data_dir"),
    ("dataset=mnist", "dataset"),
    ("model=vgg", "model"),
    ("bn=group", "bn"),
    ("assignment=roundrobin", "assignment"),
    ("partition=shards", "partition"),
    ("optimizer=adam", "optimizer"),
    ("device=tpu", "device"),
    ("engine=flowerpot", "engine"),
    ("rounds=abc", "rounds"),
    ("rounds=2.5", "rounds"),
    ("rounds=0", "rounds"),
    ("rounds=true", "rounds"),
    ("lr=fast", "lr"),
    ("lr=0", "lr"),
    ("lr=-1e-2", "lr"),
    ("width=0", "width"),
    ("batch_size=0", "batch_size"),
    ("eval_every=0", "eval_every"),
    ("eval_batch_size=-5", "eval_batch_size"),
    ("local_steps=0", "local_steps"),
    ("local_steps=abc", "local_steps"),
    ("local_steps=null", "local_steps"),
    ("local_epochs=0", "local_epochs"),
    ("local_epochs=two", "local_epochs"),
    ("local_test_ratio=0", "local_test_ratio"),
    ("momentum=1", "momentum"),
    ("momentum=-0.1", "momentum"),
    ("weight_decay=-1", "weight_decay"),
    ("betas=[0.9]", "betas"),
    ("betas=[0.9,1.0]", "betas"),
    ("betas=0.9", "betas"),
    ("seed=-1", "seed"),
    ("threads=-2", "threads"),
    ("checkpoint_every=-1", "checkpoint_every"),
    ("method_args=5", "method_args"),
    ("analysis=[1,2]", "analysis"),
    ("method=[fiarse]", "method"),
    ("lr.x=1", "lr"),
]


@pytest.mark.parametrize("override, key", BAD, ids=[b[0] for b in BAD])
def test_bad_values_name_the_key(override, key):
    # Execute / Assert
    with pytest.raises(ConfigError) as e:
        load_config(None, override.split())
    assert e.value.key == key
    assert str(e.value).startswith(f"{key}:")
    assert isinstance(e.value, UserError)


def test_unknown_key_suggests_close_names():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["round=5"])
    assert e.value.key == "round" and "rounds" in str(e.value)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["rounds"])
    assert "key=value" in str(e.value)


# --------------------------------------------------------------------------- overrides

@pytest.mark.parametrize("item, expected", [
    ("lr=0.1", ("lr", 0.1)),
    ("rounds=50", ("rounds", 50)),
    ("method_args.overlap=false", ("method_args.overlap", False)),
    ("system={1,1/4}_{1,2}", ("system", "{1,1/4}_{1,2}")),      # raw string, not YAML
    ("participation={0.1,0.15,0.2}", ("participation", "{0.1,0.15,0.2}")),
    ("out=runs/a b", ("out", "runs/a b")),
    ("data_dir=", ("data_dir", "")),
    ("local_epochs=", ("local_epochs", None)),
    ("betas=[0.9, 0.95]", ("betas", [0.9, 0.95])),
    ("dataset=digits", ("dataset", "digits")),
])
def test_parse_override(item, expected):
    assert parse_override(item) == expected


def test_overrides_are_typed_and_nested():
    # Execute
    cfg = load_config(None, ["lr=1e-2", "weight_decay=5e-4", "rounds=1e3", "width=1", "method_args.ste=paper",
                             "method_args.overlap=false", "participation={0.1,0.15,0.2}", "system={1, 1/4}_{3, 5}",
                             "analysis.magnitudes=true", "local_epochs=2", "betas=[0.9,0.95]"])
    # Assert
    assert cfg.lr == 0.01 and isinstance(cfg.lr, float)
    assert cfg.weight_decay == 5e-4
    assert cfg.rounds == 1000 and isinstance(cfg.rounds, int)
    assert cfg.width == 1.0 and isinstance(cfg.width, float)
    assert cfg.method_args == {"ste": "paper", "overlap": False}
    assert cfg.participation == pytest.approx([0.1, 0.15, 0.2])
    assert cfg.levels == [(1.0, 3), (0.25, 5)] and cfg.num_clients == 8
    assert cfg.analysis == {"magnitudes": True}
    assert cfg.local_epochs == 2.0 and cfg.betas == [0.9, 0.95]


def test_later_override_wins():
    assert load_config(None, ["rounds=3", "rounds=4"]).rounds == 4


def test_every_choice_is_accepted():
    for key, allowed in CHOICES.items():
        for value in allowed:
            extra = ["data_dir=/tmp"] if key == "dataset" and value.startswith("cifar") else []
            assert getattr(load_config(None, [f"{key}={value}", *extra]), key) == value


# --------------------------------------------------------------------------- YAML files

def test_yaml_file_and_overrides_precedence(tmp_path):
    # Prepare
    path = tmp_path / "exp.yaml"
    path.write_text("rounds: 5\nlr: 1e-2\nsystem: '{1,1/2}_{4,6}'\nparticipation: {0.1, 0.2}\n"
                    "method_args:\n  ste: paper\n  overlap: true\n")
    # Execute
    from_file = load_config(str(path))
    both = load_config(str(path), ["rounds=7", "method_args.overlap=false"])
    # Assert: the file sets values, overrides win key by key, nested mappings merge
    assert from_file.rounds == 5 and from_file.lr == 0.01 and from_file.num_clients == 10
    assert from_file.participation == pytest.approx([0.1, 0.2])
    assert both.rounds == 7 and both.lr == 0.01 and both.levels == [(1.0, 4), (0.5, 6)]
    assert both.method_args == {"ste": "paper", "overlap": False}


@pytest.mark.parametrize("text, key", [
    ("rounds: [1, 2]\n", "rounds"),
    ("lr: -0.5\n", "lr"),
    ("bogus: 1\n", "bogus"),
    ("system: 5\n", "system"),
    ("- a\n- b\n", "config"),             # not a mapping
    ("rounds: [1, 2\n", "config"),        # not valid YAML
])
def test_bad_yaml_files(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert e.value.key == key


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "nope.yaml"))
    assert e.value.key == "config"


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(str(path)).to_dict() == config_from_dict({}).to_dict()


def test_describe_keys_lists_every_key():
    text = describe_keys()
    for key in KEYS:
        assert f"  {key} " in text
