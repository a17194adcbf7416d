"""Neuron compiler flags are judged at submit: a flag neuronx-cc would refuse is a 422 naming it, before
anything is queued (compilesvc.spec.neuronx_cc_options, compilesvc.spec.flags.check_neuron_flags)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from compilesvc.ledger.models import Build
from tests.web.conftest import EnvFactory
from tests.web.support import Env, spec_for
from tests.web.test_submit import assert_problem


def neuron_spec(env: Env, args: list[str], sdk: str = "2.27.1", target: str = "trn2") -> dict[str, Any]:
    spec = spec_for(env.upload(), sdk=sdk, target=target)
    spec["compiler"] = {"args": args}
    return spec


def builds(env: Env) -> int:
    with env.services.sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Build)) or 0)


def test_unknown_flag_is_422_naming_it_and_nothing_is_queued(sqlite_env: Env) -> None:
    env = sqlite_env
    spec = neuron_spec(env, ["-O1", "--auto-cats=none"])
    for path in ("/v1/builds?queue_anyway=true", "/v1/artifacts/resolve"):
        body = assert_problem(env.client.post(path, json=spec), 422, "spec-invalid")
        assert body["errors"] == [{"field": "compiler.args[1]", "message":
                                   "unknown neuronx-cc option '--auto-cats' (did you mean '--auto-cast'?)"}]
        assert "--auto-cats" in body["detail"]
    assert builds(env) == 0


def test_flag_problems_by_release_target_and_value(sqlite_env: Env) -> None:
    env = sqlite_env
    cases = [
        (["--disable-mixed-precision-accumulation"], "2.26.1", "trn2", "from 2.27.0 on"),
        (["-lnc", "2"], "2.27.1", "trn1", "'-lnc' does not accept '2'"),
        (["--auto-cast", "matmul"], "2.27.1", "trn2", "expected one of none, matmult, all"),
        (["--auto-cast"], "2.27.1", "trn2", "'--auto-cast' needs a value"),
    ]
    for args, sdk, target, fragment in cases:
        body = assert_problem(env.submit(neuron_spec(env, args, sdk, target)), 422, "spec-invalid")
        assert body["errors"][0]["field"] == "compiler.args[0]"
        assert fragment in body["errors"][0]["message"], body
    assert builds(env) == 0


def test_documented_flags_are_accepted(sqlite_env: Env) -> None:
    env = sqlite_env
    args = ["--enable-mixed-precision-accumulation", "--pipeline compile SaveTemps", "-lnc 2",
            "--tensorizer-options=--enable-ccop-compute-overlap", "--disable-mixed-precision-accumulation"]
    response = env.submit(neuron_spec(env, args))
    assert response.status_code == 202, response.get_data(as_text=True)


def test_extra_flags_setting_accepts_an_operators_option(make_env: EnvFactory, sqlite_url: str) -> None:
    plain = make_env(sqlite_url)
    spec = neuron_spec(plain, ["--my-site-option=1"])
    assert_problem(plain.submit(spec), 422, "spec-invalid")
    extended = make_env(sqlite_url, extra_compiler_flags="--my-site-option")
    spec = neuron_spec(extended, ["--my-site-option=1"])
    assert extended.submit(spec).status_code == 202
