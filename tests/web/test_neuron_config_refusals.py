"""POST /v1/builds with a neuron_config NxD Inference cannot take is a problem+json 422 naming the field, never a
500: here the inputs that once escaped the checks as Python exceptions (a JSON integer too large for a float)."""

from __future__ import annotations

from typing import Any

from tests.spec.test_keys import needs_nxdi_toolchain
from tests.web.support import Env
from tests.web.test_compiler_flags import builds
from tests.web.test_submit import assert_problem

pytestmark = needs_nxdi_toolchain


def _spec(env: Env, neuron_config: dict[str, Any]) -> dict[str, Any]:
    return {"model": {"uri": env.upload(), "format": "hf-checkpoint"}, "target": "trn2", "sdk": "2.29.1",
            "neuron_config": {"tp_degree": 8, "seq_len": 2048, **neuron_config}}


def test_a_number_too_large_for_a_float_is_a_422_naming_the_field(sqlite_env: Env) -> None:
    env = sqlite_env
    for neuron_config, field in (
            ({"quantize_clamp_bound": 10**400}, "neuron_config.quantize_clamp_bound"),
            ({"on_device_sampling_config": {"temperature": 10**400}},
             "neuron_config.on_device_sampling_config.temperature")):
        for path in ("/v1/builds?queue_anyway=true", "/v1/artifacts/resolve"):
            body = assert_problem(env.client.post(path, json=_spec(env, neuron_config)), 422, "spec-invalid")
            [error] = body["errors"]
            assert error["field"] == field
            assert "(401 digits) is beyond the largest number" in error["message"]
    assert builds(env) == 0
