"""What the platform does to the chart's pods, as executable contracts: each function imitates only what its
cited upstream source says, nothing more.

- :func:`pod_identity_webhook`: aws/amazon-eks-pod-identity-webhook at 3bf80a348116483b2162190e43232e4d243f76c4,
  pkg/handler/handler.go (getContainersToSkip L153-170, addEnvToContainer L172-289, getPodSpecPatch L311-428,
  buildPodPatchConfig L440-507), pkg/annotations.go L27-28, main.go L82-83 (region, regional STS off) and
  L87-91 (Pod Identity's defaults).
- :func:`pod_ephemeral_limit`: kubernetes/kubernetes at 0239cd73842a07dedf025bc1c93e1b62002cd0aa,
  pkg/kubelet/eviction/eviction_manager.go podEphemeralStorageLimitEviction (the pod's limit is
  resourcehelper.PodLimits: the containers' sum, native sidecars included; evicted with
  immediateEvictionGracePeriodSeconds once containers + emptyDirs + logs pass it) and emptyDirLimitEviction;
  Kubernetes docs, "Local ephemeral storage" (kubernetes.io/docs/concepts/configuration/manage-resources-containers/).
- :func:`pod_security_violations`: Kubernetes docs, "Pod Security Standards"
  (kubernetes.io/docs/concepts/security/pod-security-standards/), the Baseline and Restricted controls the
  chart's pods touch (seccomp, AppArmor, /proc mount type, capabilities, privilege escalation, non-root,
  volume types).
"""

from __future__ import annotations

import copy
import csv
import math
import re
from typing import Any, Literal

Mode = Literal["irsa", "pod-identity"]

#: handler.go NewModifier (L96-98): IRSA's mount path, volume and token names.
IRSA_MOUNT, IRSA_VOLUME, IRSA_TOKEN = "/var/run/secrets/eks.amazonaws.com/serviceaccount", "aws-iam-token", "token"
#: main.go L88-91: Pod Identity's (container credentials) mount path, volume, token path and agent URI.
POD_IDENTITY_MOUNT = "/var/run/secrets/pods.eks.amazonaws.com/serviceaccount"
POD_IDENTITY_VOLUME = POD_IDENTITY_TOKEN = "eks-pod-identity-token"
POD_IDENTITY_URI = "http://169.254.170.23/v1/credentials"
#: pkg/annotations.go L27-28 with the default annotation domain.
SKIP_CONTAINERS = "eks.amazonaws.com/skip-containers"


def _containers_to_skip(pod: dict[str, Any]) -> set[str]:
    """getContainersToSkip: the annotation's value read as one CSV record; unparsable skips none."""
    value = pod["metadata"].get("annotations", {}).get(SKIP_CONTAINERS)
    if value is None:
        return set()
    try:
        return set(next(csv.reader([value])))
    except (csv.Error, StopIteration):
        return set()


def _add_env(container: dict[str, Any], mode: Mode, role_arn: str, region: str, token_file: str,
             volume: str, mount: str) -> None:
    """addEnvToContainer: the region pair unless one is set, then the mode's two variables unless set, then the
    token volume's mount unless mounted (the webhook's sts-regional-endpoints default is off: not added)."""
    env = container.setdefault("env", [])
    names = {e["name"] for e in env}
    if region and not names & {"AWS_REGION", "AWS_DEFAULT_REGION"}:
        env += [{"name": "AWS_DEFAULT_REGION", "value": region}, {"name": "AWS_REGION", "value": region}]
    if mode == "pod-identity":
        if not names & {"AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"}:
            env += [{"name": "AWS_CONTAINER_CREDENTIALS_FULL_URI", "value": POD_IDENTITY_URI},
                    {"name": "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", "value": token_file}]
    elif not names & {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"}:
        env += [{"name": "AWS_ROLE_ARN", "value": role_arn},
                {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": token_file}]
    mounts = container.setdefault("volumeMounts", [])
    if not any(m["name"] == volume for m in mounts):
        mounts.append({"name": volume, "readOnly": True, "mountPath": mount})


def pod_identity_webhook(pod: dict[str, Any], mode: Mode, role_arn: str = "arn:aws:iam::111122223333:role/x",
                         region: str = "us-east-1") -> dict[str, Any]:
    """The pod as the webhook admits it (a service account with a role, or a Pod Identity association):
    getPodSpecPatch's loop over initContainers (native sidecars, restartPolicy Always, included) then
    containers, skipping the names of the skip-containers annotation, plus the projected token volume."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]
    if mode == "pod-identity":
        mount, volume, token, audience = POD_IDENTITY_MOUNT, POD_IDENTITY_VOLUME, POD_IDENTITY_TOKEN, \
            "pods.eks.amazonaws.com"
        pod["metadata"].setdefault("labels", {})["eks.amazonaws.com/pod-identity"] = "enabled"
    else:
        mount, volume, token, audience = IRSA_MOUNT, IRSA_VOLUME, IRSA_TOKEN, "sts.amazonaws.com"
    skip = _containers_to_skip(pod)
    for key in ("initContainers", "containers"):
        for container in spec.get(key, []):
            if container["name"] not in skip:
                _add_env(container, mode, role_arn, region, f"{mount}/{token}", volume, mount)
    if not any(v["name"] == volume for v in spec.get("volumes", [])):
        spec.setdefault("volumes", []).insert(0, {"name": volume, "projected": {"sources": [{"serviceAccountToken": {
            "audience": audience, "expirationSeconds": 86400, "path": token}}]}})
    return pod


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: str | int) -> int:
    """A Kubernetes quantity in bytes (the storage suffixes the chart uses)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)", str(value))
    assert match and match.group(2) in _UNITS, value
    return math.ceil(float(match.group(1)) * _UNITS[match.group(2)])


def pod_ephemeral_limit(spec: dict[str, Any]) -> int | None:
    """resourcehelper.PodLimits' ephemeral-storage: the containers' limits summed with the restartable init
    containers' (native sidecars run beside them), never below a plain init container's own; None when no
    container sets one (podEphemeralStorageLimitEviction then does nothing)."""
    def limit(container: dict[str, Any]) -> int | None:
        value = container.get("resources", {}).get("limits", {}).get("ephemeral-storage")
        return None if value is None else quantity(value)

    found = [limit(c) for c in spec.get("initContainers", []) + spec["containers"]]
    if all(v is None for v in found):
        return None
    running = sum(limit(c) or 0 for c in spec["containers"]) + sum(
        limit(c) or 0 for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always")
    plain = [limit(c) or 0 for c in spec.get("initContainers", []) if c.get("restartPolicy") != "Always"]
    return max([running, *plain])


def empty_dir_budget(spec: dict[str, Any]) -> int:
    """What the pod's emptyDirs may hold before emptyDirLimitEviction: their sizeLimits summed."""
    return sum(quantity(v["emptyDir"]["sizeLimit"]) for v in spec.get("volumes", []) if "emptyDir" in v)


#: Pod Security Standards, Restricted, "Volume Types".
_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def pod_security_violations(spec: dict[str, Any], level: Literal["baseline", "restricted"]) -> list[str]:
    """The Pod Security Standards controls a pod fails at ``level`` (the fields the chart sets)."""
    found = []
    pod_context = spec.get("securityContext", {})
    for container in spec.get("initContainers", []) + spec["containers"]:
        name, context = container["name"], container.get("securityContext", {})
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        apparmor = (context.get("appArmorProfile") or pod_context.get("appArmorProfile") or {}).get("type")
        if seccomp == "Unconfined":  # Baseline "Seccomp": Undefined, RuntimeDefault, Localhost
            found.append(f"{name}: seccompProfile Unconfined")
        if apparmor == "Unconfined":  # Baseline "AppArmor": Undefined, RuntimeDefault, Localhost
            found.append(f"{name}: appArmorProfile Unconfined")
        if context.get("procMount", "Default") != "Default":  # Baseline "/proc Mount Type"
            found.append(f"{name}: procMount {context['procMount']}")
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if level == "restricted":
            if seccomp not in ("RuntimeDefault", "Localhost"):
                found.append(f"{name}: seccompProfile not RuntimeDefault or Localhost")
            if context.get("allowPrivilegeEscalation") is not False:
                found.append(f"{name}: allowPrivilegeEscalation not false")
            if "ALL" not in context.get("capabilities", {}).get("drop", []):
                found.append(f"{name}: capabilities not dropping ALL")
            if set(context.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
                found.append(f"{name}: capabilities added")
            if not (context.get("runAsNonRoot") or pod_context.get("runAsNonRoot")):
                found.append(f"{name}: runAsNonRoot not true")
    if level == "restricted":
        for volume in spec.get("volumes", []):
            kinds = set(volume) - {"name"}
            if not kinds <= _RESTRICTED_VOLUMES:
                found.append(f"volume {volume['name']}: {sorted(kinds)}")
    return found
