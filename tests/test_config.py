"""Typed config loading: unknown keys, wrong types and bad overrides are named errors."""

import pathlib

import pytest

from rudra_zmq.config import ConfigError, dump, flat_keys, load_config, to_dict

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_load_and_overrides_apply(tmp_path):
    cfg = load_config(
        write(tmp_path, "name: x\nsync: {learners: 3}\n"),
        ["optimizer.lr=0.5", "optimizer.lr_steps=[120, 130]", "data.root=/d"],
    )
    assert cfg.sync.learners == 3 and cfg.optimizer.lr == 0.5
    assert cfg.optimizer.lr_steps == [120.0, 130.0] and cfg.data.root == "/d"
    assert "learners: 3" in dump(cfg)


def test_unknown_key_is_named_with_the_valid_ones(tmp_path):
    with pytest.raises(
        ConfigError, match=r"unknown key\(s\) 'lerners' in section 'sync'.*learners"
    ):
        load_config(write(tmp_path, "sync: {lerners: 3}\n"))


def test_wrong_type_quotes_the_value(tmp_path):
    with pytest.raises(ConfigError, match=r"sync.learners must be int, got '3' \(str\)"):
        load_config(write(tmp_path, "sync: {learners: '3'}\n"))
    with pytest.raises(ConfigError, match="sync.learners must be int, got True"):
        load_config(write(tmp_path, "sync: {learners: true}\n"))


def test_int_is_accepted_where_a_float_is_expected(tmp_path):
    assert load_config(write(tmp_path, "optimizer: {lr: 1}\n")).optimizer.lr == 1.0


def test_override_must_name_an_existing_key():
    with pytest.raises(ConfigError, match="'lrr' is not a key of optimizer"):
        load_config(None, ["optimizer.lrr=1"])
    with pytest.raises(ConfigError, match="names a section"):
        load_config(None, ["optimizer=1"])
    with pytest.raises(ConfigError, match="must look like"):
        load_config(None, ["optimizer.lr"])


def test_cross_field_validation_names_the_value():
    with pytest.raises(ConfigError, match="sync.n must be between 1 and sync.learners=4.*got 5"):
        load_config(None, ["sync.protocol=softsync", "sync.n=5"])
    with pytest.raises(ConfigError, match="sync.protocol is 'sometimes'"):
        load_config(None, ["sync.protocol=sometimes"])
    with pytest.raises(ConfigError, match="runtime.transport is 'carrier pigeon'; expected one"):
        load_config(None, ["runtime.transport=carrier pigeon"])


def test_removed_keys_say_why_and_what_to_do(tmp_path):
    with pytest.raises(
        ConfigError,
        match="runtime.hot_path was removed: the compiled PS path "
        "gave 1.08x.*delete it from the config",
    ):
        load_config(str(write(tmp_path, "runtime: {hot_path: true}")), [])
    with pytest.raises(ConfigError, match="'runtime.stream_parts': that key was removed"):
        load_config(None, ["runtime.stream_parts=8"])


def test_a_run_saved_before_a_key_went_loads_when_it_holds_todays_behaviour(tmp_path):
    """Every run saved before 2026-12-03 says optimizer.momentum_policy: constant (what every
    run now does): it still loads, and resumes; the removed staleness policy does not."""
    old = write(tmp_path, "optimizer: {lr: 0.002, momentum_policy: constant}")
    assert load_config(str(old), []).optimizer.lr == 0.002
    with pytest.raises(ConfigError, match="optimizer.momentum_policy was removed: the stal"):
        load_config(str(write(tmp_path, "optimizer: {momentum_policy: staleness}")), [])


def test_missing_file_says_where_to_look(tmp_path):
    with pytest.raises(FileNotFoundError, match="see configs/"):
        load_config(tmp_path / "nope.yaml")


def test_every_shipped_config_loads():
    paths = sorted(CONFIGS.glob("*.yaml"))
    for p in paths:
        load_config(p)


def test_architecture_defaults_to_base_and_adv_takes_fanout_depth_and_leaves(tmp_path):
    assert load_config(None).architecture.kind == "base"
    cfg = load_config(
        write(
            tmp_path,
            "sync: {learners: 4, protocol: softsync}\n"
            "architecture: {kind: adv, fanout: 2, depth: 2, "
            "leaves: [[0, 3], [1, 2]]}\n",
        )
    )
    assert (cfg.architecture.fanout, cfg.architecture.depth) == (2, 2)
    assert cfg.architecture.leaves == [[0, 3], [1, 2]]


def test_architecture_errors_name_the_value_and_what_to_do():
    adv = ["architecture.kind=adv", "sync.learners=4"]
    with pytest.raises(ConfigError, match="architecture.kind is 'tree'; expected one of base, adv"):
        load_config(None, ["architecture.kind=tree"])
    with pytest.raises(ConfigError, match="architecture.fanout must be >= 1, got 0"):
        load_config(None, [*adv, "architecture.fanout=0"])
    with pytest.raises(ConfigError, match=r"in two leaves \[1\]; in no leaf \[3\]"):
        load_config(None, [*adv, "architecture.leaves=[[0,1],[1,2]]"])
    with pytest.raises(ConfigError, match=r"out of range \[7\]"):
        load_config(None, [*adv, "architecture.leaves=[[0,1,2,3,7]]"])
    with pytest.raises(ConfigError, match=r"architecture.leaves\[1\] is empty"):
        load_config(None, [*adv, "architecture.leaves=[[0,1,2,3],[]]"])
    with pytest.raises(ConfigError, match="per_gradient needs every gradient separately"):
        load_config(None, [*adv, "optimizer.lr_policy=per_gradient"])
    with pytest.raises(ConfigError, match="set architecture.kind=adv"):
        load_config(None, ["architecture.leaves=[[0,1,2,3]]"])


def test_flat_keys_are_the_dotted_keys_set_takes_and_load_back_the_same_config():
    assert flat_keys({"sync": {"learners": 8, "n": 2}, "name": "x"}) == {
        "sync.learners": 8,
        "sync.n": 2,
        "name": "x",
    }
    cfg = load_config(None, ["sync.learners=8", "optimizer.lr_steps=[3,4]"])
    flat = flat_keys(to_dict(cfg))
    assert flat["sync.learners"] == 8 and flat["optimizer.lr_steps"] == [3, 4]
    assert (
        load_config(
            None,
            [
                f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                for k, v in flat.items()
                if v is not None
            ],
        )
        == cfg
    )


def test_wire_parts_needs_hardsync_rounds_and_says_which_value_stops_it():
    hs = ["sync.protocol=hardsync"]
    assert load_config(None, [*hs, "wire.parts=16"]).wire.parts == 16
    assert load_config(None, ["wire.parts=1"]).wire.parts == 1  # any protocol, whole messages
    for value in ("0", "257"):
        with pytest.raises(
            ConfigError, match=f"wire.parts must be a whole number from 1 to 256, got {value}"
        ):
            load_config(None, [*hs, f"wire.parts={value}"])
    for extra, says in (
        (["sync.protocol=softsync"], "sync.protocol=softsync: a part is answered once every"),
        (["sync.protocol=async"], "sync.protocol=async"),
        ([*hs, "architecture.kind=adv"], "architecture.kind=adv: tree nodes"),
        ([*hs, "sync.schedule=['2 softsync 2']"], "sync.schedule"),
    ):
        with pytest.raises(
            ConfigError, match=f"wire.parts=4 needs hardsync rounds; {says}.*set wire.parts=1"
        ):
            load_config(None, [*extra, "wire.parts=4"])
