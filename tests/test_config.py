"""Tests for fedlase.config: the system-string parser, validation of every key, overrides and YAML files."""
import dataclasses
from fractions import Fraction

import pytest

from fedlase import registry
from fedlase.cli import describe_keys
from fedlase.config import (
    Config,
    config_from_dict,
    load_config,
    options,
    parse_override,
    parse_participation,
    validate,
)
from fedlase.errors import ConfigError, UserError
from fedlase.levels import Level, System
from fedlase.registry import DATASETS, METHODS, MODELS, PARTITIONS

KEYS = [f.name for f in dataclasses.fields(Config) if not f.metadata.get("derived")]


# --------------------------------------------------------------------------- system strings

F = Fraction


def pairs(system: System) -> list[tuple[Fraction, int]]:
    return [(lv.fraction, lv.count) for lv in system.levels]


@pytest.mark.parametrize("text, expected", [
    ("{1,1/4,1/16,1/64}_{10,20,30,40}", [(F(1), 10), (F(1, 4), 20), (F(1, 16), 30), (F(1, 64), 40)]),
    ("{1}_{100}", [(F(1), 100)]),
    ("{0.5,0.25}_{3,7}", [(F(1, 2), 3), (F(1, 4), 7)]),
    ("{ 1 , 1/4 } _ { 10 , 20 }", [(F(1), 10), (F(1, 4), 20)]),
    ("{1/4,1}_{5,1}", [(F(1), 1), (F(1, 4), 5)]),      # levels are ordered largest first, counts follow them
    ("{1e-1}_{2}", [(F(1, 10), 2)]),                  # a decimal is read exactly
    ("{0.3,1/3}_{1,1}", [(F(1, 3), 1), (F(3, 10), 1)]),
])
def test_parse_system_good(text, expected):
    # Execute
    got = System.parse(text)
    # Assert
    assert isinstance(got, System) and got.text == text
    assert pairs(got) == expected
    assert all(isinstance(lv.fraction, Fraction) and isinstance(lv.count, int) for lv in got.levels)
    assert [lv.index for lv in got.levels] == list(range(len(expected)))     # looked up by index
    assert got.smallest is got.levels[-1] and got.num_clients == sum(n for _, n in expected)
    # clients are numbered level by level in the order the system is written
    written = [next(lv for lv in got.levels if lv.fraction == f) for f, _ in written_pairs(text)]
    assert got.client_level == tuple(lv.index for lv in written for _ in range(lv.count))


def written_pairs(text):
    lv, ct = text.replace(" ", "").split("_")
    return [(Fraction(a), int(b)) for a, b in zip(lv.strip("{}").split(","), ct.strip("{}").split(","))]


def test_clients_follow_the_written_order():
    system = System.parse("{1/4,1}_{5,1}")
    assert [system.levels[i].name for i in system.client_level] == ["1/4"] * 5 + ["1"]


def test_level_names_floats_and_lookup():
    # Prepare
    system = System.parse("{1,1/4,1/16,1/64}_{1,2,3,4}")
    # Assert
    assert [lv.name for lv in system] == ["1", "1/4", "1/16", "1/64"]
    assert [float(lv) for lv in system] == [1.0, 0.25, 0.0625, 0.015625]
    assert system.find(F(1, 4)) is system.levels[1]
    assert system.find("1/16") is system.levels[2] and system.find(0.015625) is system.levels[3]
    assert system.find(0.5) is None and system.find("x") is None
    assert system.find("1/64") is system.smallest
    assert len(system) == 4 and list(system) == list(system.levels)
    # the same system written in another order or from pairs gives the same levels
    assert pairs(System.of([(F(1, 4), 2), (1.0, 1), (0.0625, 3), ("1/64", 4)])) == pairs(system)
    assert pairs(System.of([0.25, 1.0])) == [(F(1), 1), (F(1, 4), 1)]
    assert Level(1, F(1, 4), 2) == system.levels[1]


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
        System.parse(text)
    assert e.value.key == "system"
    assert str(e.value).startswith("system:")
    assert "\n" not in str(e.value)


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

def test_validate_returns_a_checked_copy_and_the_config_is_never_changed():
    raw = config_from_dict({"participation": "{0.1,0.2}", "lr": "1e-2"}, validate_=False)
    cfg = validate(raw)
    assert (raw.participation, raw.lr) == ("{0.1,0.2}", "1e-2")   # the input is left as it was
    assert (cfg.participation, cfg.lr) == ([0.1, 0.2], 0.01)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.out = "elsewhere"   # a variant is dataclasses.replace(cfg, out=...)
    assert dataclasses.replace(cfg, system="{1}_{3}").num_clients == 3 and cfg.num_clients == 100


def test_defaults_validate():
    # Execute
    cfg = config_from_dict({})
    # Assert: the paper's system, and derived fields filled
    assert isinstance(cfg.levels, System)
    assert pairs(cfg.levels) == [(F(1), 10), (F(1, 4), 20), (F(1, 16), 30), (F(1, 64), 40)]
    assert cfg.num_clients == 100
    client_level = cfg.levels.client_level
    assert len(client_level) == 100
    assert client_level[:10] == (0,) * 10 and cfg.levels.levels[client_level[10]].fraction == F(1, 4)
    assert cfg.levels.levels[client_level[-1]].fraction == F(1, 64) and cfg.levels.smallest.name == "1/64"
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
    ("lr=inf", "lr"),                                 # every number must be finite
    ("lr=.inf", "lr"),
    ("lr=nan", "lr"),
    ("lr=.nan", "lr"),
    ("width=inf", "width"),
    ("alpha=nan", "alpha"),
    ("reply_timeout=inf", "reply_timeout"),
    ("local_epochs=inf", "local_epochs"),
    ("betas=[0.9,.nan]", "betas"),
    ("min_replies=0", "min_replies"),
    ("min_replies=-1", "min_replies"),
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
    assert "\n" not in str(e.value)                   # the CLI prints it as one line
    assert isinstance(e.value, UserError)


@pytest.mark.parametrize("override", ["lr=inf", "lr=nan", "min_replies=0"])
def test_non_finite_lr_and_zero_min_replies_are_one_line_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert e.value.key == key and str(e.value).startswith(f"{key}: ")
    assert len(str(e.value).splitlines()) == 1
    assert ("finite" if key == "lr" else ">= 1") in str(e.value)
    assert load_config(None, ["min_replies=1", "lr=1e-3"]).min_replies == 1   # the limits themselves are valid


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
    ("betas=[0.9, 0.95]", ("betas", [0.9, 0.95])),
    ("dataset=digits", ("dataset", "digits")),
])
def test_parse_override(item, expected):
    assert parse_override(item) == expected


@pytest.mark.parametrize("item", ["data_dir=", "local_epochs=", "coverage=", "coverage= ", "system="])
def test_an_empty_override_is_an_error(item):
    """`key=` never means "unset": it names the key (leave the key out for its default)."""
    with pytest.raises(ConfigError) as e:
        parse_override(item)
    assert e.value.key == item.split("=")[0] and "empty value" in str(e.value)


@pytest.mark.parametrize("key", ["out", "data_dir", "superlink", "method"])
def test_an_empty_string_is_an_error(key):
    with pytest.raises(ConfigError) as e:
        config_from_dict({key: "  "})
    assert e.value.key == key


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
    assert pairs(cfg.levels) == [(F(1), 3), (F(1, 4), 5)] and cfg.num_clients == 8
    assert cfg.analysis == {"magnitudes": True}
    assert cfg.local_epochs == 2.0 and cfg.betas == [0.9, 0.95]


def test_later_override_wins():
    assert load_config(None, ["rounds=3", "rounds=4"]).rounds == 4


def _tiny_causal() -> str:
    """A tiny random LlamaForCausalLM folder, made once per session (no tokenizer: validation reads the config)."""
    import tempfile

    import transformers
    global _TINY_CAUSAL
    if _TINY_CAUSAL is None:
        _TINY_CAUSAL = tempfile.mkdtemp(prefix="fedlase-tiny-causal-")
        conf = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
        transformers.LlamaForCausalLM(conf).save_pretrained(_TINY_CAUSAL)
    return _TINY_CAUSAL


_TINY_CAUSAL = None


def _partner(key: str, value: str) -> list[str]:
    """Other keys a choice needs to validate: a model of the dataset's kind, a data_dir where it needs one."""
    if key == "dataset":
        entry = DATASETS.get(value)
        model = next(n for n, m in MODELS.items() if m.kind == entry.kind)
        return [f"model={model}"] + (["data_dir=/tmp"] if entry.needs_data_dir else [])
    if key == "model":
        kind = MODELS.get(value).kind
        data = next(n for n, d in DATASETS.items() if d.kind == kind and not d.needs_data_dir)
        if value == "hf":   # checked at validation: a local Hugging Face folder (the packaged MiniLM's)
            from fedlase.models.transformer import minilm_path
            return [f"dataset={data}", f"model_path={minilm_path()}"]
        if value == "hf_causal":   # a local causal LM folder: a tiny random Llama's
            return [f"dataset={data}", f"model_path={_tiny_causal()}"]
        return [f"dataset={data}"]
    if key == "task" and value == "lm":   # next-token prediction: a decoder on a text dataset
        return ["dataset=bbc_news", "model=hf_causal", f"model_path={_tiny_causal()}"]
    if key == "head_norm" and value != "none":   # a text model's option
        return ["dataset=bbc_news", "model=minilm"]
    if key == "method" and METHODS.get(value).models is not None:   # a method that runs on some models only
        return [f"model={METHODS.get(value).models[0]}"]
    if key == "method" and METHODS.get(value).adapters:   # an adapter method: LoRA on a text model
        return ["dataset=bbc_news", "model=minilm", "lora.r=4"]
    return []


def test_every_choice_is_accepted():
    with_choices = {k: o.allowed() for k, o in options().items() if o.allowed() is not None}
    assert {"dataset", "model", "partition", "method", "bn", "assignment", "optimizer", "device",
            "engine"} <= set(with_choices)
    assert "dynamic" in with_choices["assignment"]
    for key, allowed in with_choices.items():
        assert allowed
        for value in allowed:
            assert getattr(load_config(None, [f"{key}={value}", *_partner(key, value)]), key) == value


def test_registry_choices_are_the_registries():
    assert {"fashion_mnist", "cifar10", "cifar100", "digits"} <= set(DATASETS)
    assert {"cnn", "resnet18", "lenet"} <= set(MODELS)
    assert set(PARTITIONS) == {"iid", "dirichlet", "balanced_dirichlet", "pathological", "goliath"}
    assert {"fedlase", "fiarse", "heterofl", "fedrolex", "fedavg"} <= set(METHODS)
    assert {DATASETS.get(n).num_classes for n in ("fashion_mnist", "cifar10", "digits")} == {10}
    assert DATASETS.get("cifar100").num_classes == 100
    for key, reg in (("dataset", DATASETS), ("model", MODELS), ("partition", PARTITIONS), ("method", METHODS)):
        assert options()[key].allowed() == reg.names()
        with pytest.raises(ConfigError) as e:
            reg.get("no_such_choice")
        assert e.value.key == key and "no_such_choice" in str(e.value)


def test_a_registered_choice_is_valid_in_the_config():
    # Prepare: register a dataset, model, partition and method from outside the package
    from fedlase.methods import FedAvg
    name = "dummy_registered"
    dummy_method = type("DummyMethod", (FedAvg,), {"name": name, "__doc__": "a test method"})
    for key in ("dataset", "model", "partition", "method"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={name}"])
        assert e.value.key == key
    with registry.temporary():
        registry.register_dataset(name, lambda cfg: None, num_classes=3, help="a test dataset")
        registry.register_model(name, lambda cfg, data: None, help="a test model")
        registry.register_partition(name, lambda labels, n, cfg: None, help="a test partition")
        registry.register_method(dummy_method)
        # Execute
        cfg = load_config(None, [f"dataset={name}", f"model={name}", f"partition={name}", f"method={name}"])
        # Assert: accepted, listed in the help, and its class count checked
        assert (cfg.dataset, cfg.model, cfg.partition, cfg.method) == (name,) * 4
        for key in ("dataset", "model", "partition", "method"):
            assert name in options()[key].allowed()
        assert describe_keys().count(name) == 4
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"dataset={name}", "partition=pathological", "classes_per_client=4"])
        assert e.value.key == "classes_per_client" and "3 classes" in str(e.value)
        assert load_config(None, [f"dataset={name}", "partition=pathological", "classes_per_client=3"])
        with pytest.raises(ValueError, match="registered already"):
            registry.register_dataset(name, lambda cfg: None, num_classes=3)
    # Assert: gone again
    for key in ("dataset", "model", "partition", "method"):
        assert name not in options()[key].allowed()
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={name}"])
        assert e.value.key == key


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
    assert both.rounds == 7 and both.lr == 0.01 and pairs(both.levels) == [(F(1), 4), (F(1, 2), 6)]
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
