"""Pydantic models of the OperatingSystemConfig as Gardener writes it into ``data["osc.yaml"]``.

Field names follow the Go JSON tags (camelCase). Unknown fields are ignored, so a newer Gardener
that adds fields does not break an older agent. The loosely modelled parts (``criConfig``,
``inPlaceUpdates``, metadata extras) keep whatever they are given so nothing is lost when the
object is written back to disk as last-applied state. Models are immutable; lists are tuples.

Typed fields are as strict as upstream's typed decoder: ``permissions`` must be an integer,
``enable`` and ``transmitUnencoded`` booleans, ``command`` one of start, restart, stop. A string,
float or boolean there is an error instead of being coerced (``"0644"`` would otherwise become
mode 0o1204, ``true`` mode 0o1).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool
from pydantic.alias_generators import to_camel

API_VERSION = "extensions.gardener.cloud/v1alpha1"
KIND = "OperatingSystemConfig"

UnitCommandName = Literal["start", "restart", "stop"]


def _integer(value: object) -> object:
    """Only a YAML/JSON integer is a mode; ``bool`` is an ``int`` in Python, so check the type."""
    if value is not None and type(value) is not int:
        raise ValueError("permissions must be an integer (octal in YAML such as 0644, or 420)")
    return value


Permissions = Annotated[int | None, BeforeValidator(_integer)]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class _LooseModel(BaseModel):
    """A part we carry along without interpreting; every field survives a round trip."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", frozen=True
    )


class InlineContent(_Model):
    encoding: str = ""
    data: str = ""


class SecretRefContent(_Model):
    name: str
    data_key: str


class ImageRefContent(_Model):
    image: str
    file_path_in_image: str


class FileContent(_Model):
    inline: InlineContent | None = None
    secret_ref: SecretRefContent | None = None
    image_ref: ImageRefContent | None = None
    transmit_unencoded: StrictBool | None = None


class File(_Model):
    path: str
    permissions: Permissions = None
    content: FileContent
    host_name: str | None = None


class DropIn(_Model):
    name: str
    content: str


class Unit(_Model):
    name: str
    command: UnitCommandName | None = None
    enable: StrictBool | None = None
    content: str | None = None
    drop_ins: tuple[DropIn, ...] = ()
    file_paths: tuple[str, ...] = ()


class CRIConfig(_LooseModel):
    name: str = "containerd"
    cgroup_driver: str | None = None
    containerd: dict[str, Any] | None = None


class KubeletUpdate(_LooseModel):
    """``spec.inPlaceUpdates.kubelet`` as newer Gardener sends it: the version and the settings
    whose change needs an in-place update (CPU manager policy, eviction and reserved resources)."""

    version: str = ""
    cpu_manager_policy: str | None = None


class InPlaceUpdates(_LooseModel):
    operating_system_version: str = ""
    #: Gardener v1.150 sends the kubelet's version as a string, newer Gardener an object; both
    #: are kept as they came (``kubelet_version`` reads either).
    kubelet: str | KubeletUpdate = ""
    credentials_rotation: dict[str, Any] | None = None

    @property
    def kubelet_version(self) -> str:
        return self.kubelet if isinstance(self.kubelet, str) else self.kubelet.version


class InPlaceUpdatesStatus(_LooseModel):
    os_update: dict[str, Any] | None = None


class ObjectMeta(_LooseModel):
    name: str | None = None
    namespace: str | None = None


class OSCSpec(_Model):
    type: str = ""
    purpose: str = ""
    cri_config: CRIConfig | None = None
    units: tuple[Unit, ...] = ()
    files: tuple[File, ...] = ()
    in_place_updates: InPlaceUpdates | None = None


class OSCStatus(_Model):
    extension_units: tuple[Unit, ...] = ()
    extension_files: tuple[File, ...] = ()
    in_place_updates: InPlaceUpdatesStatus | None = None


class OperatingSystemConfig(_Model):
    api_version: str = API_VERSION
    kind: str = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: OSCSpec = Field(default_factory=OSCSpec)
    status: OSCStatus = Field(default_factory=OSCStatus)

    def to_dict(self) -> dict[str, Any]:
        """Return the object as Gardener would serialize it (camelCase, no null fields)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
