"""Why a build compiled instead of hitting the cache: its artifact's key material against the closest
earlier artifact of the same model, as the changes a person reads ("sdk 2.20.0 → 2.21.0", "flag -O2 →
-O3", "bucket input_ids: int64[4, 512] is new").

"The same model" is the model's name when the build gave one (a new revision under the same name is the
most common miss of all, and shows as a changed model sha256), else its content sha256. Among the most
recent :data:`CANDIDATES` earlier artifacts of that model, the one with the fewest changes is compared
(the newest of those on a tie): the artifact built just before may be another target altogether, while
the user's question is which of their edits made the key new.

Keys hash canonical material (:mod:`compilesvc.spec.keys`), so every change listed here is one the key saw;
two artifacts with no listed change would have had one key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from compilesvc.access.team_reads import EVERYTHING, Reader, build_conditions
from compilesvc.ledger.models import Artifact, ArtifactBucket, BucketCompile, Build
from compilesvc.spec.keys import shape_text
from compilesvc.states import Outcome

__all__ = ["CANDIDATES", "Change", "Comparison", "changes", "explain_miss", "given_fields"]

#: How many earlier artifacts of the model are considered (newest first).
CANDIDATES = 50
#: A spec's short-form neuron_config field and the NeuronConfig fields it sets (compilesvc.spec.nxdi_config).
SHORT_FORMS = {"buckets": ("enable_bucketing", "context_encoding_buckets", "token_generation_buckets")}


@dataclass(frozen=True)
class Change:
    """One difference between two keys' material: ``component`` is the key component it falls in
    (``model``, ``toolchain``, ``neuron_config``, ``flags``, ``buckets``, ``salt``, ``schema``)."""

    component: str
    text: str


@dataclass(frozen=True)
class Comparison:
    """The earlier artifact compared with (and a build that asked for it), and what changed since."""

    artifact_key: str
    artifact_state: str
    build_id: int
    sdk: str
    changes: tuple[Change, ...]


def _short(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64:
        return value[:12] + "…"  # a sha256: enough to tell two apart
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _flag_groups(flags: list[str]) -> dict[str, str]:
    """Canonical flags by name: an option with the values that follow it (``--pipeline compile SaveTemps``,
    as canonical_flags writes several values) is one group; leading positionals are one group."""
    groups: list[list[str]] = []
    for token in flags:
        if token.startswith("-") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    found: dict[str, str] = {}
    for group in groups:
        head = group[0]
        name = "-O" if head.startswith("-O") and head[2:].isdigit() else head.partition("=")[0]
        if not head.startswith("-"):
            name = "(positional)"
        found[name] = " ".join(group) if name not in found else f"{found[name]} {' '.join(group)}"
    return found


def _flag_changes(before: list[str], after: list[str]) -> list[Change]:
    """Canonical flags are ``name``, ``name=value`` or ``name value…`` (one per option, sorted): a changed
    value reads as ``-O2 → -O3``, the rest as added or removed. Should that find nothing where the lists
    differ (an order the key sees and the names do not), both lists are shown whole."""
    old, new = _flag_groups(before), _flag_groups(after)
    found = []
    for name in sorted(old.keys() | new.keys()):
        was, now = old.get(name), new.get(name)
        if was == now:
            continue
        if was is None:
            found.append(Change("flags", f"flag {now} added"))
        elif now is None:
            found.append(Change("flags", f"flag {was} removed"))
        else:
            found.append(Change("flags", f"flag {was} → {now}"))
    if not found and before != after:
        found.append(Change("flags", f"flags {' '.join(before) or '(none)'} → {' '.join(after) or '(none)'}"))
    return found


def _mapping_changes(component: str, label: str, before: dict[str, Any], after: dict[str, Any],
                     sep: str = " ") -> list[Change]:
    """One change per differing leaf, named by its path (``label`` + names joined by ``sep``)."""
    found = []
    for name in sorted(before.keys() | after.keys()):
        was, now = before.get(name), after.get(name)
        if was == now:
            continue
        if (isinstance(was, dict) and isinstance(now, dict)) or (
                sep == "." and isinstance(was or now, dict) and None in (was, now)):
            # (dotted paths: a mapping appearing, such as pre-sharded weights' digests, reads entry by entry)
            found.extend(_mapping_changes(component, f"{label}{name}{sep}", was or {}, now or {}, sep))
        elif was is None:
            found.append(Change(component, f"{label}{name} {_short(now)} added"))
        elif now is None:
            found.append(Change(component, f"{label}{name} {_short(was)} removed"))
        else:
            found.append(Change(component, f"{label}{name} {_short(was)} → {_short(now)}"))
    return found


def given_fields(*specs: dict[str, Any]) -> frozenset[str]:
    """The NeuronConfig fields some of ``specs`` (builds' specs as submitted) wrote, the short form expanded."""
    names: set[str] = set()
    for spec in specs:
        for name in spec.get("neuron_config") or {}:
            names.update(SHORT_FORMS.get(name, (name,)))
    return frozenset(names)


def _neuron_config_changes(before: dict[str, Any], after: dict[str, Any],
                           given: frozenset[str] | None) -> list[Change]:
    """One line per changed NeuronConfig field; with ``given`` (the fields the two builds' specs wrote), the
    fields NxDI derives from those (seq_len moves max_context_length, n_positions, …; tp_degree world_size)
    follow on one line, so the field the user edited reads alone ("neuron_config.seq_len 256 → 512")."""
    label = "neuron_config."
    if given is None:
        return _mapping_changes("neuron_config", label, before, after, ".")
    changed = {name for name in before.keys() | after.keys() if before.get(name) != after.get(name)}
    derived = changed - given
    if not derived or derived == changed:  # nothing the user wrote changed (a release's default): every field
        return _mapping_changes("neuron_config", label, before, after, ".")
    written = _mapping_changes("neuron_config", label, {k: v for k, v in before.items() if k not in derived},
                               {k: v for k, v in after.items() if k not in derived}, ".")
    follow = _mapping_changes("neuron_config", "", {k: v for k, v in before.items() if k in derived},
                              {k: v for k, v in after.items() if k in derived}, ".")
    return [*written, Change("neuron_config", "neuron_config fields NxDI derives from these changed with them: "
                                              + ", ".join(c.text for c in follow))]


def changes(before: dict[str, Any], before_buckets: list[list[dict[str, Any]]], before_sdk: str,
            after: dict[str, Any], after_buckets: list[list[dict[str, Any]]], after_sdk: str,
            given: frozenset[str] | None = None) -> list[Change]:
    """What changed from one artifact's key material (set-level ``material``, its buckets' inputs, its SDK
    release label) to another's, component by component in the key's order. ``given``: the NeuronConfig
    fields the builds' specs wrote (:func:`given_fields`), which the NeuronConfig lines lead with."""
    found: list[Change] = []
    if before.get("schema") != after.get("schema"):
        found.append(Change("schema", f"key schema {before.get('schema')} → {after.get('schema')}"))
    if before.get("salt") != after.get("salt"):
        found.append(Change("salt", "the service's key salt changed (an operator disowned earlier artifacts)"))
    if "neuron_config" in before or "neuron_config" in after:
        # An NxD Inference key: its config.json and NeuronConfig fields by their dotted names, one per line
        # ("model.config.num_hidden_layers 2 → 4", "neuron_config.tp_degree 8 → 16").
        found.extend(_mapping_changes("model", "model.", before.get("model", {}), after.get("model", {}), "."))
    else:
        found.extend(_mapping_changes("model", "model ", before.get("model", {}), after.get("model", {})))
    old_tools, new_tools = dict(before.get("toolchain", {})), dict(after.get("toolchain", {}))
    # The cpu target's toolchain holds its sdk (the torch release) and says it below.
    if before_sdk != after_sdk and old_tools != new_tools and "sdk" not in new_tools:
        # The release label is not in the key (releases shipping one toolchain share artifacts), but it is
        # what the user changed: name it, then the packages it brought.
        found.append(Change("toolchain", f"sdk {before_sdk} → {after_sdk}"))
    found.extend(_mapping_changes("toolchain", "", old_tools, new_tools))
    found.extend(_neuron_config_changes(dict(before.get("neuron_config") or {}),
                                        dict(after.get("neuron_config") or {}), given))
    found.extend(_flag_changes(list(before.get("flags", [])), list(after.get("flags", []))))
    old_shapes = {shape_text(inputs): inputs for inputs in before_buckets}
    new_shapes = {shape_text(inputs): inputs for inputs in after_buckets}
    found.extend(Change("buckets", f"bucket {text} is new") for text in sorted(new_shapes.keys() - old_shapes.keys()))
    found.extend(Change("buckets", f"bucket {text} dropped") for text in sorted(old_shapes.keys() - new_shapes.keys()))
    return found


def _bucket_inputs(session: Session, artifact_ids: list[int]) -> dict[int, list[list[dict[str, Any]]]]:
    found: dict[int, list[list[dict[str, Any]]]] = {artifact_id: [] for artifact_id in artifact_ids}
    rows = session.execute(
        select(ArtifactBucket.artifact_id, BucketCompile.inputs)
        .join(BucketCompile, BucketCompile.id == ArtifactBucket.bucket_compile_id)
        .where(ArtifactBucket.artifact_id.in_(artifact_ids))
        .order_by(ArtifactBucket.artifact_id, ArtifactBucket.position)
    )
    for artifact_id, inputs in rows:
        found[artifact_id].append(inputs)
    return found


def explain_miss(session: Session, build: Build, reader: Reader = EVERYTHING) -> Comparison | None:
    """The closest earlier artifact of ``build``'s model and the changes from it to ``build``'s, or None
    when no earlier build of this model asked for another artifact (a first build of a model). Only the
    builds ``reader`` may read are candidates (:mod:`compilesvc.access.team_reads`)."""
    same_model = (Build.model_name == build.model_name) if build.model_name else \
        (Build.model_sha256 == build.model_sha256)
    # Hits are most of a model's builds and ask for the artifacts it has already: walking the builds that
    # made or joined an artifact finds the model's distinct artifacts in far fewer rows (an artifact only
    # ever imported from the store has hits alone, and is not a candidate).
    earlier = session.execute(
        select(Build.artifact_id, Build.id)
        .where(same_model, Build.id < build.id, Build.artifact_id != build.artifact_id, Build.outcome != Outcome.HIT,
               *build_conditions(reader))
        .order_by(Build.id.desc())
        .limit(CANDIDATES * 4)  # a few joins per artifact; the walk stays short
    ).all()
    newest_build: dict[int, int] = {}
    for artifact_id, build_id in earlier:
        newest_build.setdefault(artifact_id, build_id)
        if len(newest_build) == CANDIDATES:
            break
    if not newest_build:
        return None
    ids = [*newest_build, build.artifact_id]
    artifacts = {a.id: a for a in session.scalars(select(Artifact).where(Artifact.id.in_(ids)))}
    inputs = _bucket_inputs(session, ids)
    mine = artifacts[build.artifact_id]
    specs: dict[int, dict[str, Any]] = {}
    if "neuron_config" in mine.material:  # what each build's spec wrote leads its NeuronConfig lines
        specs = dict(session.execute(select(Build.id, Build.spec).where(Build.id.in_(newest_build.values()))).all())
    best: Comparison | None = None
    for artifact_id, build_id in newest_build.items():  # newest first: a later tie never replaces it
        other = artifacts[artifact_id]
        given = given_fields(build.spec, specs.get(build_id) or {}) if specs else None
        found = changes(other.material, inputs[artifact_id], other.sdk,
                        mine.material, inputs[mine.id], mine.sdk, given)
        if best is None or len(found) < len(best.changes):
            best = Comparison(other.key, other.state, build_id, other.sdk, tuple(found))
    return best
