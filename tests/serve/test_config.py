"""The one configuration object: layers, parsing, validation and the errors a user sees."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from engine.config import DEFAULT_MODEL, Config, ConfigError, format_size, parse_size
from serve.config import (
    add_cli_args,
    config_from,
    config_from_args,
    load_config,
    load_config_or_exit,
    parse_args,
)


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "raypd.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_are_valid() -> None:
    config = Config()
    assert config.model == DEFAULT_MODEL and Path(DEFAULT_MODEL).is_absolute()
    assert config.model_name == "tiny-hybrid"
    assert config.kv_cache_memory == 256 << 20
    assert config.colocated and config.decode == 1
    assert config.device == "auto"
    assert load_config([], {}) == config


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().port = 1  # type: ignore[misc]


def test_precedence_defaults_yaml_env_cli(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "port: 9001\nmax-num-seqs: 8\nseed: 3\nhost: 0.0.0.0\n")
    env = {"RAYPD_MAX_NUM_SEQS": "16", "RAYPD_SEED": "4"}
    config = load_config(["--config", path, "--seed", "5"], env)
    assert config.port == 9001  # YAML over the default
    assert config.host == "0.0.0.0"
    assert config.max_num_seqs == 16  # env over YAML
    assert config.seed == 5  # CLI over env over YAML
    assert config.max_num_batched_tokens == 2048  # untouched default shows through


def test_yaml_file_from_env(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "decode: 2\nprefill: 1\n")
    config = load_config([], {"RAYPD_CONFIG": path})
    assert (config.prefill, config.decode, config.colocated) == (1, 2, False)


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(["--config", write_yaml(tmp_path, "")], {}) == Config()


@pytest.mark.parametrize("flag, value", [("--async-scheduling", True), ("--no-async-scheduling", False)])
def test_boolean_flags_both_ways(flag: str, value: bool) -> None:
    assert load_config([flag], {"RAYPD_ASYNC_SCHEDULING": str(not value)}).async_scheduling is value


@pytest.mark.parametrize(
    "text, value",
    [
        ("true", True),
        ("Yes", True),
        ("1", True),
        ("on", True),
        ("false", False),
        ("NO", False),
        ("0", False),
        ("off", False),
    ],
)
def test_boolean_env_values(text: str, value: bool) -> None:
    assert load_config([], {"RAYPD_ENABLE_PREFIX_CACHING": text}).enable_prefix_caching is value


def test_cli_flags_with_vllm_names() -> None:
    config = load_config(
        [
            "--num-gpu-blocks-override",
            "100",
            "-tp",
            "1",
            "--served-model-name",
            "tiny",
            "--dtype",
            "BFloat16",
            "--log-level",
            "debug",
            "--max-model-len",
            "none",
        ],
        {},
    )
    assert (config.num_kv_blocks, config.tensor_parallel_size) == (100, 1)
    assert (config.model_name, config.dtype, config.log_level) == ("tiny", "bfloat16", "DEBUG")
    assert config.max_model_len is None
    assert load_config(["--num-kv-blocks", "7"], {}).num_kv_blocks == 7


def test_tp_flags_per_role() -> None:
    config = load_config(["--prefill-tp", "2", "--decode-tp", "1"], {})
    assert (config.prefill, config.tp_size("prefill"), config.tp_size("decode")) == (1, 2, 1)
    config = load_config(["-tp", "2", "--prefill", "2", "--decode-tp", "4"], {})
    assert (config.prefill, config.tp_size("prefill"), config.tp_size("decode")) == (2, 2, 4)
    assert load_config(["-tp", "2"], {}).tp_size("colocated") == 2


def test_none_overrides_a_lower_layer() -> None:
    config = load_config(["--block-size", "none"], {"RAYPD_BLOCK_SIZE": "16", "RAYPD_API_KEY": ""})
    assert config.block_size is None and config.api_key is None


@pytest.mark.parametrize(
    "text, size",
    [
        ("1000000", 1_000_000),
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("1 GB", 10**9),
        ("4k", 4000),
        ("2KiB", 2048),
        ("1.5GiB", 3 << 29),
        ("64b", 64),
        ("1TiB", 1 << 40),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MiB", "1XiB", "-1MiB", "0.5B", "1 Mi B"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("size", [1, 1000, 1024, 256 << 20, 3 << 29, (1 << 40) * 5])
def test_format_size_round_trips(size: int) -> None:
    assert parse_size(format_size(size)) == size


def test_memory_size_in_every_layer(tmp_path: Path) -> None:
    assert load_config(["--kv-cache-memory", "1GiB"], {}).kv_cache_memory == 1 << 30
    assert load_config([], {"RAYPD_KV_CACHE_MEMORY": "512MiB"}).kv_cache_memory == 512 << 20
    path = write_yaml(tmp_path, "kv_cache_memory: 2MiB\n")
    assert load_config(["--config", path], {}).kv_cache_memory == 2 << 20
    path = write_yaml(tmp_path, "kv_cache_memory: 4096\n")
    assert load_config(["--config", path], {}).kv_cache_memory == 4096


@pytest.mark.parametrize(
    "field, value",
    [
        ("port", 0),
        ("port", 65536),
        ("block_size", 0),
        ("num_kv_blocks", -1),
        ("kv_cache_memory", 0),
        ("max_num_batched_tokens", 0),
        ("prefill_max_num_batched_tokens", 0),
        ("prefill_max_num_batched_tokens", "256"),
        ("max_num_seqs", 0),
        ("max_model_len", 0),
        ("max_waiting", 0),
        ("prefill", -1),
        ("decode", 0),
        ("tensor_parallel_size", 0),
        ("worker_threads", 0),
        ("seed", -1),
        ("dtype", "float64"),
        ("kv_cache_dtype", "int8"),
        ("device", "tpu"),
        ("log_level", "LOUD"),
        ("async_scheduling", "yes"),
        ("port", True),
        ("port", "8000"),
        ("model", ""),
        ("host", None),
        ("served_model_name", 7),
    ],
)
def test_invalid_value_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        Config(**{field: value})
    assert info.value.field == field
    assert repr(value) in str(info.value)


def test_batched_tokens_must_cover_running_requests() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens 8: must be >= max_num_seqs"):
        Config(max_num_batched_tokens=8)
    assert Config(max_num_batched_tokens=8, max_num_seqs=8).max_num_batched_tokens == 8
    with pytest.raises(ConfigError, match="prefill_max_num_batched_tokens 8: must be >= max_num_seqs") as info:
        Config(prefill_max_num_batched_tokens=8)
    assert info.value.field == "prefill_max_num_batched_tokens"


@pytest.mark.parametrize(
    "fields, role, device, budget",
    [
        ({}, "colocated", "cpu", 2048),
        ({}, "decode", "cpu", 2048),
        ({}, "prefill", "cpu", 256),
        ({}, "prefill", "cuda", 2048),
        ({"max_num_seqs": 300}, "prefill", "cpu", 300),
        ({"max_num_batched_tokens": 128}, "prefill", "cpu", 128),
        ({"prefill_max_num_batched_tokens": 1024}, "prefill", "cpu", 1024),
        ({"prefill_max_num_batched_tokens": 100}, "prefill", "cuda", 100),
        ({"prefill_max_num_batched_tokens": 100}, "decode", "cpu", 2048),
    ],
)
def test_step_token_budget(fields: dict[str, int], role: str, device: str, budget: int) -> None:
    """Only a prefill engine's steps shrink, and by default only on a CPU."""
    assert Config(**fields).step_token_budget(role, device) == budget  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--port", "abc"], {}, "invalid port 'abc': must be an integer (from --port)"),
        ([], {"RAYPD_PORT": "70000"}, "invalid port 70000: must be in 1..65535 (from RAYPD_PORT)"),
        ([], {"RAYPD_ASYNC_SCHEDULING": "maybe"}, "invalid async_scheduling 'maybe'"),
        (["--kv-cache-memory", "lots"], {}, "invalid kv_cache_memory 'lots': expected a byte count"),
        (["-tp", "65"], {}, "invalid tensor_parallel_size 65: must be in 1..64 (from --tensor-parallel-size)"),
    ],
)
def test_layer_errors_name_value_and_source(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, env)
    assert message in str(info.value)


def test_yaml_error_names_the_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "decode: 0\n")
    with pytest.raises(ConfigError, match=f"invalid decode 0: must be >= 1 \\(from {path}\\)"):
        load_config(["--config", path], {})


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_num_seq: 4\n", "unknown key 'max_num_seq' in config file .* \\(did you mean 'max_num_seqs'\\?\\)"),
        ("- port\n", "must map field names to values"),
        ("port: [\n", "not valid YAML"),
    ],
)
def test_bad_yaml_files_are_rejected(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", write_yaml(tmp_path, text)], {})


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(["--config", str(tmp_path / "absent.yaml")], {})


def test_unknown_env_variable_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown environment variable RAYPD_FOO"):
        load_config([], {"RAYPD_FOO": "1"})
    with pytest.raises(ConfigError, match="did you mean 'RAYPD_PORT'"):
        load_config([], {"RAYPD_PROT": "1"})
    assert load_config([], {"OTHER_FOO": "1", "RAYPD": "x"}) == Config()


def test_load_config_or_exit_gives_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config_or_exit(["--port", "70000"], {})
    assert info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "70000" in last and "port" in last
    assert "Traceback" not in err


def test_parse_args_keeps_extra_flags() -> None:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--smoke", action="store_true")

    ns = parse_args(["--smoke", "--decode", "3"], {}, extra)
    assert ns.smoke and ns.config.decode == 3


def test_absent_flags_leave_no_attribute() -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    ns = parser.parse_args(["--port", "1234"])
    assert vars(ns) == {"port": "1234"}
    assert config_from(ns, {}).port == 1234


def test_describe_lists_every_field_and_masks_the_key() -> None:
    config = Config(api_key="sk-secret")
    text = config.describe()
    lines = text.splitlines()
    assert [line.split(" = ")[0].strip() for line in lines] == [f.name for f in dataclasses.fields(Config)]
    assert "sk-secret" not in text and "sk-secret" not in repr(config)
    assert any(line.split() == ["api_key", "=", "***"] for line in lines)
    assert "kv_cache_memory" in text and "256MiB" in text
    assert any(line.split() == ["api_key", "=", "None"] for line in Config().describe().splitlines())


def test_dict_round_trip() -> None:
    config = Config(port=9000, api_key="k", prefill=1, kv_cache_memory=1 << 30)
    data = config.to_dict()
    assert isinstance(data, dict) and data["port"] == 9000
    assert Config.from_dict(data) == config
    with pytest.raises(ConfigError, match="unknown config field 'prot'"):
        Config.from_dict({"prot": 1})


def test_engine_ranges_default_to_the_started_counts() -> None:
    cfg = load_config(["--prefill", "2", "--decode", "3"])
    assert cfg.engine_range("prefill") == (2, 2) and cfg.engine_range("decode") == (3, 3)
    assert not cfg.autoscaling
    cfg = load_config(
        ["--prefill", "1", "--decode", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "4"]
    )
    assert cfg.engine_range("prefill") == (1, 2) and cfg.engine_range("decode") == (1, 4)
    assert cfg.autoscaling
    assert cfg.inflight_limit == 4 * (cfg.max_num_seqs + cfg.max_waiting)  # what the most engines hold


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "1", "--decode", "2", "--min-decode", "3"], "invalid min_decode 3: more than the 2 decode"),
        (["--prefill", "2", "--max-prefill", "1"], "invalid max_prefill 1: fewer than the 2 prefill"),
        (["--prefill", "0", "--max-prefill", "2"], "invalid max_prefill 2: colocated engines"),
        (["--api-replicas", "0"], "invalid api_replicas 0: must be >= 1"),
        (["--scale-decode-kv-percent", "101"], "invalid scale_decode_kv_percent 101: must be in 1..100"),
    ],
)
def test_bad_scaling_values_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(argv)


def test_serve_application_args_are_config_fields() -> None:
    """`serve run serve.app:build prefill=2 ...` passes text; a config file's `args:` YAML values."""
    cfg = config_from_args({"prefill": "2", "max-decode": 3, "api_replicas": "2"})
    assert (cfg.prefill, cfg.engine_range("decode"), cfg.api_replicas) == (2, (1, 3), 2)
    with pytest.raises(ConfigError, match=r"unknown key 'prefil' in the application's args \(did you mean 'prefill'"):
        config_from_args({"prefil": 2})
    with pytest.raises(ConfigError, match=r"invalid decode 'x': must be an integer \(from the application's args\)"):
        config_from_args({"decode": "x"})
