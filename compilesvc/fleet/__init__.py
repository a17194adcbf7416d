"""compilesvc for serving code: verified artifacts on local disk, the bucket for a request, padding.

::

    from compilesvc.fleet import ArtifactSet, pad

    artifacts = ArtifactSet.open("9f2c…", cache_dir="/var/cache/compilesvc")   # or a spec file
    bucket = artifacts.select({"input_ids": ids, "attention_mask": mask})    # smallest that fits
    model = bucket.load()                                                     # imports torch only here
    out = model(**pad({"input_ids": ids, "attention_mask": mask}, bucket))

Importing this package imports neither torch nor numpy, nor any web or worker code; see docs/fleet.md
for the cache, the selection policy, the host check and the trusted keys every open checks the
artifact's signature against. An NxD Inference (LLM) artifact is one compiled directory:
``artifacts.llm`` reads its neuron_config.json, and :func:`check_serving` compares it with vLLM's
serving arguments (docs/fleet.md, "LLM artifacts for vLLM").
"""

from compilesvc.fleet._artifact_set import ArtifactSet, LocalBucket
from compilesvc.fleet._binding import NotTheSpec
from compilesvc.fleet._cache import ArtifactCache, CacheError, FilesDiffer, Verify, default_cache_dir
from compilesvc.fleet._fetch import Fetcher, FetchReport, NotCached, Progress, ServedDiffers
from compilesvc.fleet._host import HostCheck, HostReport, VersionMismatch, VersionMismatchWarning
from compilesvc.fleet._llm import LLMArtifact, NeuronConfigUnreadable, NotAnLLMArtifact
from compilesvc.fleet._pad import crop, pad
from compilesvc.fleet._remote import FleetError, NotPublished, Remote, Unreachable, Untrusted
from compilesvc.fleet._select import Miss, NoBucketFits, select
from compilesvc.fleet._serving import (
    ServingArgs,
    ServingArgsError,
    check_loadable,
    check_serving,
    parse_vllm_args,
    vllm_environment,
    vllm_serving_args,
)
from compilesvc.fleet._serving_dir import ServingDirRefused, make_serving_dir

__all__ = [
    "ArtifactCache",
    "ArtifactSet",
    "CacheError",
    "FetchReport",
    "Fetcher",
    "FilesDiffer",
    "FleetError",
    "HostCheck",
    "HostReport",
    "LLMArtifact",
    "LocalBucket",
    "Miss",
    "NeuronConfigUnreadable",
    "NoBucketFits",
    "NotAnLLMArtifact",
    "NotCached",
    "NotPublished",
    "NotTheSpec",
    "Progress",
    "Remote",
    "ServedDiffers",
    "ServingArgs",
    "ServingArgsError",
    "ServingDirRefused",
    "Unreachable",
    "Untrusted",
    "Verify",
    "VersionMismatch",
    "VersionMismatchWarning",
    "check_loadable",
    "check_serving",
    "crop",
    "default_cache_dir",
    "make_serving_dir",
    "pad",
    "parse_vllm_args",
    "select",
    "vllm_environment",
    "vllm_serving_args",
]
