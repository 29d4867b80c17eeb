"""A typed view of ``spec.criConfig`` (the OSC model keeps it loose, so nothing is lost).

Field names and defaults follow Gardener's ``extensions/v1alpha1`` types (CRIConfig,
ContainerdConfig, RegistryConfig, RegistryHost, PluginConfig). Parsing is strict where a wrong value
would end up in containerd's configuration: a malformed criConfig is an ``OSCValidationError`` that
names the field, before anything is planned.
"""

from __future__ import annotations

import math
import unicodedata
from typing import Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from node_agent.base.errors import OSCValidationError
from node_agent.osc.models import CRIConfig

CRI_NAME_CONTAINERD = "containerd"
FIELD = "spec.criConfig"

Capability = Literal["pull", "resolve", "push"]


class _Spec(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class PluginConfig(_Spec):
    """One edit of containerd's ``plugins`` table: ``add`` merges ``values`` at ``path`` (creating
    the table), ``remove`` deletes the key at ``path``."""

    op: Literal["add", "remove"] = "add"
    path: tuple[StrictStr, ...] = Field(min_length=1)
    values: dict[str, Any] | None = None

    @field_validator("path")
    @classmethod
    def _keys(cls, path: tuple[str, ...]) -> tuple[str, ...]:
        if any(not key for key in path):
            raise ValueError("path elements must not be empty")
        return path

    @field_validator("values")
    @classmethod
    def _toml_values(cls, values: dict[str, Any] | None) -> dict[str, Any] | None:
        if values is not None:
            _check_toml(values, "values")
        return values


class RegistryHost(_Spec):
    url: StrictStr = Field(min_length=1)
    capabilities: tuple[Capability, ...] = ()
    ca_certs: tuple[StrictStr, ...] = ()
    override_path: StrictBool | None = None

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return url


class RegistryConfig(_Spec):
    upstream: StrictStr
    server: StrictStr | None = None
    hosts: tuple[RegistryHost, ...] = ()
    readiness_probe: StrictBool | None = None

    @field_validator("upstream")
    @classmethod
    def _one_directory(cls, upstream: str) -> str:
        # It names a directory below certs.d: one path component, nothing that escapes it.
        if not upstream or "/" in upstream or upstream in (".", "..") or "\x00" in upstream:
            raise ValueError("must be a registry host name such as docker.io or localhost:5000")
        if _odd(upstream):
            raise ValueError(f"{upstream!r} {_ODD}: not a registry host name")
        return upstream

    @model_validator(mode="after")
    def _plain_urls(self) -> Self:
        """The server and host URLs become TOML keys and values containerd matches requests
        against: a space, quote or line break there is a mistake, never a registry."""
        if self.server is not None and _odd(self.server):
            raise ValueError(f"registry {self.upstream!r}: server {self.server!r} {_ODD}")
        for host in self.hosts:
            if _odd(host.url):
                raise ValueError(f"registry {self.upstream!r}: host {host.url!r} {_ODD}")
        return self


class ContainerdConfig(_Spec):
    registries: tuple[RegistryConfig, ...] = ()
    sandbox_image: StrictStr = ""
    plugins: tuple[PluginConfig, ...] = ()

    @field_validator("registries")
    @classmethod
    def _unique(cls, registries: tuple[RegistryConfig, ...]) -> tuple[RegistryConfig, ...]:
        seen: set[str] = set()
        for registry in registries:
            if registry.upstream in seen:
                raise ValueError(f"upstream {registry.upstream!r} appears twice")
            seen.add(registry.upstream)
        return registries


class ContainerdCRI(_Spec):
    """What the agent derives containerd's configuration from."""

    name: StrictStr
    cgroup_driver: Literal["systemd", "cgroupfs"] | None = None
    containerd: ContainerdConfig


def containerd_cri(cri: CRIConfig | None) -> ContainerdCRI | None:
    """The typed criConfig when it asks for containerd's configuration, else None.

    Like upstream, that is ``name: containerd`` with a ``containerd`` section (Gardener always
    sets one, with the sandbox image, for a reconcile OSC)."""
    if cri is None or cri.name != CRI_NAME_CONTAINERD or cri.containerd is None:
        return None
    raw = {"name": cri.name, "cgroupDriver": cri.cgroup_driver, "containerd": cri.containerd}
    try:
        return ContainerdCRI.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = FIELD + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        raise OSCValidationError(f"{where}: {err['msg']}", field=where) from None


_ODD = "contains a space, quote, backslash or control character"


def _odd(text: str) -> bool:
    """True if ``text`` has whitespace, a quote, a backslash or a control/format character."""
    return any(
        ch.isspace() or ch in "\"'\\" or unicodedata.category(ch).startswith("C") for ch in text
    )


def _check_toml(value: object, where: str) -> None:
    """JSON that TOML cannot hold (null, integers beyond 64 bits) is refused here, naming the
    field, instead of producing a config.toml containerd cannot read."""
    if value is None:
        raise ValueError(f"{where}: null has no TOML form")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} has no JSON form")
    if type(value) is int and not -(2**63) <= value < 2**63:
        raise ValueError(f"{where}: {value} does not fit TOML's 64-bit integers")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"{where}: keys must be non-empty strings")
            _check_toml(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_toml(item, f"{where}[{index}]")
