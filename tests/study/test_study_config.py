"""The study's configuration: every bad key or value is a ConfigError naming it."""

import pytest

from opdjax.study import study_config
from opdjax.config import ConfigError


def test_study_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="did you mean 'delta'"):
        study_config.load_study(None, ["detla=0.1"])
    with pytest.raises(ConfigError, match="unknown recipe 'fp9'"):
        study_config.load_study(None, ["recipes=[fp9]"])
    with pytest.raises(ConfigError, match="base/point config: unknown key 'pipeline.stepz'"):
        study_config.load_study(None, ["base.pipeline.stepz=3"])
    with pytest.raises(ConfigError, match="shift.corrections"):
        study_config.load_study(None, ["shift.corrections=[token_tiss]"])
