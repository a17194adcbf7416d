"""The build page's provenance panel: the artifact's signed SLSA provenance, verified before it is shown.

The statement is read from the store (``artifacts/<key>/provenance.json``) and shown only if it verifies
under this service's own signing key or a key of ``COMPILESVC_TRUSTED_KEYS``: a page must not present a
document the service did not sign as its provenance. Otherwise the panel says why (unsigned, not
verifiable) instead.
"""

from __future__ import annotations

from typing import Any

from compilesvc.signing.artifacts import provenance_summary, verify_provenance
from compilesvc.signing.keys import KeyFileError, SignatureError
from compilesvc.states import ArtifactState
from compilesvc.store.base import StoreError, artifact_provenance_name
from web.context import WebContext


def provenance_view(ctx: WebContext, artifact_key: str, state: str) -> dict[str, Any] | None:
    """What the panel shows: None before the artifact is published; else ``summary`` (verified) or
    ``problem`` (why there is none to show)."""
    if state != ArtifactState.PUBLISHED:
        return None
    try:
        raw = ctx.services.store.read_document(artifact_provenance_name(artifact_key))
    except StoreError as exc:
        return {"problem": f"the store cannot be read ({exc})"}
    if raw is None:
        return {"problem": "published without a signature or provenance (see docs/deploy.md, signing keys)"}
    try:
        verified = verify_provenance(ctx.services.trusted_keys(), raw, artifact_key)
    except (SignatureError, KeyFileError) as exc:
        return {"problem": str(exc)}
    summary = provenance_summary(verified)
    own = ctx.services.signer
    summary["own_key"] = own is not None and own.key.key_id == verified.key_id
    return {"summary": summary}
