"""A secret setting read from a file: `SQUALL_<SECTION>__<FIELD>_FILE=path` (how the containers
get their Redis credentials without putting them in the environment)."""

from __future__ import annotations

import pytest

from squall.shared.config import load_config
from squall.shared.errors import ConfigError

URL = "redis://squall-runner:s3cret@redis:6379/0"


def test_a_setting_is_read_from_its_file_stripped(tmp_path):
    secret = tmp_path / "redis_url"
    secret.write_text(URL + "\n")
    cfg = load_config(env={"SQUALL_RUN__REDIS_URL_FILE": str(secret), "SQUALL_RUN__SEED": "3"})
    assert cfg.run.redis_url == URL
    assert cfg.run.seed == 3  # plain variables still apply beside a file


def test_a_non_string_field_is_validated_from_its_file(tmp_path):
    (tmp_path / "lr").write_text(" -1 ")
    with pytest.raises(ConfigError, match=r"trainer\.lr"):
        load_config(env={"SQUALL_TRAINER__LR_FILE": str(tmp_path / "lr")})


def test_a_missing_file_names_the_variable_and_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as err:
        load_config(env={"SQUALL_RUN__REDIS_URL_FILE": str(missing)})
    assert "SQUALL_RUN__REDIS_URL_FILE" in str(err.value) and str(missing) in str(err.value)


def test_the_value_and_its_file_together_are_refused(tmp_path):
    secret = tmp_path / "redis_url"
    secret.write_text(URL)
    with pytest.raises(
        ConfigError, match="SQUALL_RUN__REDIS_URL_FILE and SQUALL_RUN__REDIS_URL are both set"
    ):
        load_config(env={"SQUALL_RUN__REDIS_URL_FILE": str(secret), "SQUALL_RUN__REDIS_URL": URL})


def test_a_file_variable_for_no_field_is_an_unknown_field_error(tmp_path):
    with pytest.raises(ConfigError, match="nonsense_file"):
        load_config(env={"SQUALL_RUN__NONSENSE_FILE": str(tmp_path / "x")})
