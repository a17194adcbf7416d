"""``compilesvc serve-env``: an NxD Inference artifact handed to vLLM, with the check vLLM does not make.

The artifact is fetched exactly as ``compilesvc fetch`` fetches it (the cache, offline too; the signature is
checked first), then its compiled directory's neuron_config.json gives the environment (``NEURON_COMPILED_ARTIFACTS``
and the framework) and the serving arguments that match it. Given vLLM's arguments after ``--``, every mismatch is
one ``error:`` line (:func:`compilesvc.fleet.check_serving` says which comparisons are equalities and which bounds,
with vLLM's and NxDI's lines), so a fleet refuses to start vLLM rather than serve a mismatched artifact or compile
for hours on the serving host.

Exit status: 0 the environment is printed (and the arguments, if given, match); 1 the fetch failed (as
``compilesvc fetch``); 2 the command line is wrong (a malformed KEY, a spec that does not validate, a vLLM
argument that cannot be read, an artifact that is not an NxD Inference compile); 3 the artifact is not trusted
(as ``compilesvc fetch``); 4 the vLLM arguments do not match the artifact, or vLLM could not load it on this host
whatever its arguments (its weights are not where NxDI reads them): one ``error:`` line each.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import click

from compilesvc.cli.connection import API_OPTION
from compilesvc.cli.fetch import _Bar, open_set
from compilesvc.cli.main import BadInput, CommandFailed, SpecUsageError
from compilesvc.fleet import (
    ArtifactSet,
    LLMArtifact,
    NeuronConfigUnreadable,
    NotAnLLMArtifact,
    ServingArgsError,
    ServingDirRefused,
    check_loadable,
    check_serving,
    make_serving_dir,
    parse_vllm_args,
    vllm_environment,
    vllm_serving_args,
)
from compilesvc.spec.parsing import SpecError, load_spec_file
from compilesvc.store.base import SHA256_RE

#: The exit status of a refusal: the serving arguments do not match the artifact.
MISMATCH_EXIT = 4
#: The shell variable the sh format puts the matching vLLM arguments in (not exported: they are arguments).
ARGS_VARIABLE = "VLLM_SERVE_ARGS"


def _llm(artifacts: ArtifactSet) -> LLMArtifact:
    try:
        return artifacts.llm
    except NotAnLLMArtifact as exc:
        raise BadInput(str(exc)) from None
    except NeuronConfigUnreadable as exc:
        raise CommandFailed(str(exc)) from None


@click.command("serve-env", context_settings={"ignore_unknown_options": True})
@click.argument("key", required=False)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--spec", "spec_path", type=click.Path(dir_okay=False, path_type=Path),
              help="The artifact of this spec file (resolved as `compilesvc fetch --spec` resolves it).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path),
              help="The artifact cache (default: $COMPILESVC_CACHE_DIR, else ~/.cache/compilesvc).")
@click.option("--offline", is_flag=True, help="Never contact the API: the cache only.")
@click.option("--checkpoint", type=click.Path(file_okay=False, path_type=Path),
              help="The HF checkpoint directory whose weights a shard-on-load artifact (no weights/) is served with; "
                   "needs --serving-dir.")
@click.option("--serving-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Make this directory (absent, empty or an earlier one) of links to the compiled files and the "
                   "--checkpoint's files, and point NEURON_COMPILED_ARTIFACTS at it (NxDI reads the weights there).")
@click.option("--format", "fmt", type=click.Choice(["sh", "json"]), default="sh", show_default=True,
              help="sh: export lines to eval; json: one document.")
@click.option("--verify", type=click.Choice(["sha256", "size"]), default="sha256", show_default=True,
              help="How cached files are checked before use: every byte, or sizes only.")
@click.option("--check-host", is_flag=True,
              help="Refuse (exit 1) unless this host's torch / torch-neuronx / runtime match the artifact's recorded "
                   "versions (as `compilesvc fetch --check-host`).")
@click.option("-q", "--quiet", is_flag=True, help="No progress or summary on stderr.")
@API_OPTION
def serve_env(key: str | None, vllm_args: tuple[str, ...], spec_path: Path | None, cache_dir: Path | None,
              offline: bool, checkpoint: Path | None, serving_dir: Path | None, fmt: str, verify: str,
              check_host: bool, quiet: bool, api: str | None) -> None:
    """Print the environment and vLLM arguments for serving the NxD Inference artifact KEY (or --spec SPEC);
    with vLLM's arguments after `--`, refuse (exit 4) every one that does not match the artifact. An artifact
    vLLM could not load here (its weights not where NxDI reads them) is refused (exit 4) either way.

    \b
      eval "$(compilesvc serve-env KEY)" && vllm serve /models/llama $VLLM_SERVE_ARGS
      compilesvc serve-env KEY -- --model /models/llama --tensor-parallel-size 8 --max-num-seqs 4 ...
      compilesvc serve-env KEY --checkpoint /models/llama --serving-dir /srv/llama -- --model /models/llama ...

    Exit status: 0 printed (and matching); 1 the fetch failed; 2 the command line is wrong (or the artifact
    is not an NxD Inference compile); 3 not trusted; 4 the vLLM arguments do not match (docs/fleet.md).
    """
    if key is not None and spec_path is not None and not SHA256_RE.match(key):
        vllm_args, key = (key, *vllm_args), None  # `--spec s.yaml -- --tp 8`: click put the first one in KEY
    if (key is None) == (spec_path is None):
        raise BadInput("give an artifact KEY or --spec SPEC (one of them)")
    if key is not None and not SHA256_RE.match(key):
        raise BadInput(f"{key!r} is not an artifact key (64 lowercase hex digits)")
    if (checkpoint is None) != (serving_dir is None):
        raise BadInput("--checkpoint and --serving-dir go together")
    ref: Any = key
    if spec_path is not None:
        try:
            ref = load_spec_file(spec_path, limits=None, extra_flags=None)
        except SpecError as exc:
            raise SpecUsageError(str(spec_path), exc) from None
    try:
        args = parse_vllm_args(vllm_args) if vllm_args else None
    except ServingArgsError as exc:
        raise BadInput(f"vLLM arguments: {exc}") from None
    artifact = _llm(open_set(ref, cache_dir, api, offline, verify, check_host, False, 4,
                             _Bar(not quiet and fmt == "sh")))
    if checkpoint is not None and serving_dir is not None:
        try:
            artifact = make_serving_dir(artifact, checkpoint, serving_dir)
        except ServingDirRefused as exc:
            raise BadInput(str(exc)) from None
    problems = check_serving(artifact, args) if args is not None else check_loadable(artifact)
    if problems:
        for problem in problems:
            click.echo(f"error: {problem}", err=True)
        raise click.exceptions.Exit(MISMATCH_EXIT)
    environment = vllm_environment(artifact)
    arguments = vllm_serving_args(artifact)
    if fmt == "json":
        click.echo(json.dumps(_document(artifact, environment, arguments, args is not None), indent=1))
        return
    for name, value in environment.items():
        click.echo(f"export {name}={shlex.quote(value)}")
    click.echo(f"{ARGS_VARIABLE}={shlex.quote(shlex.join(arguments))}")
    if not quiet and args is not None:
        click.echo(f"{artifact.key}: the vLLM arguments match the artifact", err=True)


def _document(artifact: LLMArtifact, environment: dict[str, str], arguments: list[str],
              checked: bool) -> dict[str, Any]:
    nc = artifact.neuron_config
    return {"key": artifact.key, "directory": str(artifact.compiled_model_path), "environment": environment,
            "vllm_args": arguments, "checked": checked,
            "weights": "pre-sharded" if artifact.presharded else "checkpoint",
            "name_or_path": artifact.name_or_path,
            "neuron_config": {name: nc.get(name) for name in (
                "tp_degree", "batch_size", "seq_len", "max_context_length", "torch_dtype", "is_continuous_batching",
                "is_prefix_caching", "is_block_kv_layout", "pa_block_size", "pa_num_blocks",
                "enable_fused_speculation", "speculation_length", "save_sharded_checkpoint")}}
