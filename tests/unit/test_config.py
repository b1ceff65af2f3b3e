"""Configuration: the standard AWS sources, their precedence, and validation. No server."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from s3ckpt import ConfigError, S3Config, WriteOptions
from s3ckpt.config import MiB, parse_s3_url


def test_endpoint_precedence_service_specific_then_global() -> None:
    env = {"AWS_ENDPOINT_URL": "http://global:1", "AWS_ENDPOINT_URL_S3": "http://s3:2/"}
    assert S3Config().resolve(env).endpoint_url == "http://s3:2"
    assert (
        S3Config().resolve({"AWS_ENDPOINT_URL": "http://global:1"}).endpoint_url
        == "http://global:1"
    )
    explicit = S3Config(endpoint_url="http://arg:3").resolve(env)
    assert explicit.endpoint_url == "http://arg:3"


def test_several_endpoints() -> None:
    resolved = S3Config(endpoint_url=["http://a:1/", "http://b:2"]).resolve({})
    assert resolved.endpoint_urls == ("http://a:1", "http://b:2")
    assert resolved.endpoint_url == "http://a:1" and resolved.addressing_style == "path"
    with pytest.raises(ConfigError):
        S3Config(endpoint_url=[])
    with pytest.raises(ConfigError):
        S3Config(endpoint_url=["http://a:1", "a:2"])


def test_ignore_configured_endpoint_urls() -> None:
    env = {"AWS_ENDPOINT_URL": "http://global:1", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}
    assert S3Config().resolve(env).endpoint_url is None


def test_path_style_by_default_only_with_an_endpoint() -> None:
    assert S3Config(endpoint_url="http://x:1").resolve({}).addressing_style == "path"
    assert S3Config().resolve({}).addressing_style == "virtual"
    forced = S3Config(endpoint_url="http://x:1", addressing_style="virtual").resolve({})
    assert forced.addressing_style == "virtual"


def test_region_precedence() -> None:
    both = {"AWS_REGION": "eu-west-3", "AWS_DEFAULT_REGION": "ap-south-1"}
    assert S3Config().resolve(both).region == "eu-west-3"
    assert S3Config().resolve({"AWS_DEFAULT_REGION": "ap-south-1"}).region == "ap-south-1"
    assert S3Config(region="us-west-2").resolve(both).region == "us-west-2"
    assert S3Config().resolve({}).region == "us-east-1"


def test_profile_from_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "config"
    config_file.write_text(
        "[profile flash]\nregion = eu-central-1\nendpoint_url = http://flashblade:80\n"
        "[profile nested]\ns3 =\n  endpoint_url = http://nested:81\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config_file))
    resolved = S3Config(profile="flash").resolve({})
    assert (resolved.region, resolved.endpoint_url) == ("eu-central-1", "http://flashblade:80")
    assert resolved.addressing_style == "path"
    assert S3Config().resolve({"AWS_PROFILE": "nested"}).endpoint_url == "http://nested:81"
    with pytest.raises(ConfigError, match="nope"):
        S3Config(profile="nope").resolve({})


def test_tls_settings(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("not checked here")
    assert S3Config().resolve({}).verify is True
    assert S3Config(verify=False).resolve({"AWS_CA_BUNDLE": str(bundle)}).verify is False
    assert S3Config().resolve({"AWS_CA_BUNDLE": str(bundle)}).verify == str(bundle)
    assert S3Config(ca_bundle=str(bundle)).resolve({}).verify == str(bundle)
    with pytest.raises(ConfigError, match=r"missing\.pem"):
        S3Config(ca_bundle=str(tmp_path / "missing.pem")).resolve({})


def test_checksums_are_explicit_and_retries_bounded() -> None:
    options = S3Config(max_attempts=3).resolve({}).botocore_options()
    assert options["request_checksum_calculation"] == "when_required"
    assert options["response_checksum_validation"] == "when_required"
    assert options["retries"]["total_max_attempts"] == 1, "s3ckpt retries, not botocore"
    assert options["s3"]["payload_signing_enabled"] is False
    assert options["max_pool_connections"] >= S3Config().max_concurrency


@pytest.mark.parametrize(
    "kwargs",
    [
        {"part_size": 1 * MiB},
        {"max_concurrency": 0},
        {"addressing_style": "sideways"},
        {"max_attempts": 0},
        {"read_timeout": 0},
        {"retry_timeout": 0},
        {"access_key_id": "only-half"},
        {"endpoint_url": "ftp://x"},
        {"multipart_threshold": -1},
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        S3Config(**kwargs)  # type: ignore[arg-type]


def test_secrets_stay_out_of_repr_and_config_pickles() -> None:
    config = S3Config(
        access_key_id="AKIDEXAMPLE", secret_access_key="SECRETSECRET", session_token="TOKTOK"
    )
    assert "SECRETSECRET" not in repr(config) and "TOKTOK" not in repr(config)
    assert "SECRETSECRET" not in repr(config.resolve({}))
    assert pickle.loads(pickle.dumps(config)) == config


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    for bad in ("bucket/a", "s3:///a", "http://x/y"):
        with pytest.raises(ConfigError):
            parse_s3_url(bad)


def test_retries_are_bounded_by_time_by_default() -> None:
    assert S3Config().max_attempts is None and S3Config().retry_timeout == 60
    assert S3Config(max_attempts=3).max_attempts == 3, "a cap given is kept"
    assert S3Config().min_read_rate > 0
    for invalid in ({"min_read_rate": 0}, {"max_attempts": 0}):
        with pytest.raises(ValueError):
            S3Config(**invalid)  # type: ignore[arg-type]


def test_max_record_size_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_record_size"):
        S3Config(max_record_size=0)


def test_compression_needs_a_known_codec() -> None:
    with pytest.raises(ValueError, match="zstd"):
        WriteOptions(compression="lz4")  # type: ignore[arg-type]


def test_write_options_defaults() -> None:
    options = WriteOptions()
    assert options.objects_per_rank == 4
    assert options.frame_size == 4 * MiB == 4 * 1024 * 1024
    assert options.compression is None
    assert options.compression_level == 1
    assert options.shuffle is True
    assert options.spread_keys is False


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"objects_per_rank": 0}, "objects_per_rank"),
        ({"frame_size": 1024}, "frame_size"),
        ({"compression": "lz4"}, "compression"),
    ],
)
def test_invalid_write_options_are_refused_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        WriteOptions(**kwargs)  # type: ignore[arg-type]


def test_write_options_are_frozen() -> None:
    options = WriteOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.frame_size = 8 * MiB  # type: ignore[misc]
    assert options.frame_size == 4 * MiB
