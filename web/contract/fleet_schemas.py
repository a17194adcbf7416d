"""Request and response models of the fleet-lifecycle endpoints: roll-forward campaigns, retention pins
and service-wide event subscriptions (the rest of the API's models are :mod:`web.contract.schemas`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from compilesvc import states
from compilesvc.spec.compile_spec import Target
from web.contract.schemas import BuildState, JsonBool, JsonNumber, Outcome, _Out

_SDK = Field(pattern=r"^\d+\.\d+\.\d+$", max_length=32, description='A release number, e.g. "2.21.0".')


class RollforwardIn(BaseModel):
    """POST /v1/campaigns/rollforward: move every published artifact of ``from_sdk`` (narrowed by model
    name, target and labels) to ``to_sdk``."""

    model_config = ConfigDict(extra="forbid")

    from_sdk: str = _SDK
    to_sdk: str = _SDK
    model: str | None = Field(default=None, min_length=1, max_length=200, description="Only this model name.")
    target: Target | None = None
    labels: dict[Annotated[str, Field(min_length=1, max_length=64)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=32, description="Only artifacts with a build carrying every one.")
    pinned: JsonBool = Field(default=False, description="Only artifacts a retention pin keeps.")
    fetched_within_days: JsonNumber | None = Field(default=None, gt=0, le=3650,
                                              description="Only artifacts fetched by key within this many days.")
    dry_run: JsonBool = Field(default=False, description="List what would be submitted; submit nothing.")
    queue_anyway: JsonBool = Field(default=False, description="Queue compiles even while no worker serves the new "
                                                          "release (they wait for one).")


class CampaignFailure(_Out):
    source_key: str
    build_id: int
    artifact_key: str
    position: int | None = None
    inputs: list[dict[str, Any]] | None = None
    error_class: str | None = None
    error_code: str | None = None
    error_message: str | None = None


class CampaignItemOut(_Out):
    source_key: str = Field(description="The artifact rolled forward.")
    build_id: int | None = Field(description="The build for the new release (null: refused).")
    state: BuildState | None
    outcome: Outcome | None
    artifact_key: str | None = Field(description="The new release's artifact.")
    refusal: str | None


class CampaignProgress(_Out):
    total: int
    submitted: int
    building: int
    built: int = Field(description="Compiled (or joined a compile) and published.")
    hit: int = Field(description="Published already for the new release.")
    failed: int
    cancelled: int
    refused: int = Field(description="Submits the new release refused (see `refusals`).")


class CampaignOut(_Out):
    id: int
    kind: Literal["rollforward"]
    policy_id: int | None = Field(description="The standing policy that started it (null: an operator).")
    from_sdk: str
    to_sdk: str
    selection: dict[str, Any]
    state: Literal[tuple(s.value for s in states.CampaignState)]  # type: ignore[valid-type]
    created_by: str | None
    created_at: datetime
    finished_at: datetime | None
    progress: CampaignProgress
    failures: list[CampaignFailure]
    refusals: list[dict[str, str]]
    items: list[CampaignItemOut]
    url: str


class CampaignList(_Out):
    items: list[CampaignOut]


class RollforwardPlanItem(_Out):
    source_key: str
    build_id: int = Field(description="The build whose spec would be resubmitted.")
    model_name: str | None
    target: str
    key: str | None = Field(description="The new release's artifact key (null: the spec is refused).")
    state: str | None = Field(description="What the ledger knows of that key: absent, building, published, …; "
                                            "`pinning` while its model is hashed in the background (no key yet).")
    refusal: str | None


class RollforwardPlan(_Out):
    dry_run: Literal[True]
    from_sdk: str
    to_sdk: str
    items: list[RollforwardPlanItem]


class PolicyIn(BaseModel):
    """POST /v1/rollforward-policies: when the first worker of a new SDK release registers for a target the
    policy covers, roll the selected artifacts forward to that release."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$", description="Unique; letters, digits, `.`, `_`, `-`.")
    target: Literal["inf2", "trn1", "trn2", "cpu"] | None = Field(
        default=None, description="Only this target's new releases and artifacts (null: every target).")
    from_sdk: str | None = Field(default=None, pattern=r"^\d+\.\d+\.\d+$", max_length=32,
                                 description="The release to move from (null: the newest release older than "
                                             "the new one with published artifacts for the target).")
    model: str | None = Field(default=None, min_length=1, max_length=200, description="Only this model name.")
    labels: dict[Annotated[str, Field(min_length=1, max_length=64)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=32, description="Only artifacts with a build carrying every one.")
    pinned: JsonBool = Field(default=False, description="Only artifacts a retention pin keeps.")
    fetched_within_days: JsonNumber | None = Field(default=None, gt=0, le=3650,
                                              description="Only artifacts fetched by key within this many days.")
    enabled: JsonBool = Field(default=True, description="A disabled policy starts nothing.")


class PolicyRunOut(_Out):
    to_sdk: str
    target: str = Field(description="The target whose first worker of `to_sdk` fired the policy.")
    worker_id: str
    from_sdk: str | None
    campaign_id: int | None = Field(description="null: no campaign started (see `note`).")
    campaign_url: str | None
    note: str | None
    created_at: datetime


class PolicyOut(_Out):
    id: int
    name: str
    target: str | None
    from_sdk: str | None
    model: str | None
    labels: dict[str, str]
    pinned: bool
    fetched_within_days: float | None
    enabled: bool
    created_by: str | None
    created_at: datetime
    runs: list[PolicyRunOut] = Field(description="Each release the policy fired for, newest first.")
    url: str


class PolicyList(_Out):
    items: list[PolicyOut]


class _PinIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    note: str | None = Field(default=None, max_length=1000, description="Why (shown in lists).")


class ArtifactPinIn(_PinIn):
    kind: Literal["artifact"]
    value: str = Field(pattern="^[0-9a-f]{64}$", description="The artifact's key.")


class ModelPinIn(_PinIn):
    kind: Literal["model"]
    value: str = Field(min_length=1, max_length=200, description="A model name (the spec's model.name).")


class LabelPinIn(_PinIn):
    kind: Literal["label"]
    value: str = Field(pattern="^[^:\\u0000]+:[^\\u0000]*$", max_length=1100,
                       description="`name:value` of a build label (text without NUL, as everywhere).")


class PinCreate(RootModel[Annotated[ArtifactPinIn | ModelPinIn | LabelPinIn, Field(discriminator="kind")]]):
    """POST /v1/pins: keep one artifact (by key), every artifact of a model name, or every artifact with a
    build carrying a label."""


class PinOut(_Out):
    id: int
    kind: Literal["artifact", "model", "label"]
    value: str
    note: str | None
    created_by: str | None
    created_at: datetime


class PinList(_Out):
    items: list[PinOut]


class SubscriptionCreate(BaseModel):
    """POST /v1/subscriptions: POST every ``event`` to ``url`` (signed as webhooks are; docs/api.md)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048, pattern=r"^https?://[^\x00-\x20\x7f]+$")
    event: Literal[tuple(e.value for e in states.ServiceEvent)]  # type: ignore[valid-type]


class SubscriptionDelivery(_Out):
    id: str = Field(description="The Compilesvc-Webhook-Id of its tries.")
    subject_id: int | None = Field(description="The artifact, build or campaign the event is about.")
    state: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None


class SubscriptionOut(_Out):
    id: int
    url: str
    event: str
    created_by: str | None
    created_at: datetime
    recent_deliveries: list[SubscriptionDelivery] = Field(description="The last 20, newest first.")


class SubscriptionList(_Out):
    items: list[SubscriptionOut]
