"""The seam fakes every unit test of pure logic shares: ``FakeKube`` and ``FakeSystemd``.

Integration tests never use them: they run against a real API server and a real systemd. These
stand in only where a test is about the agent's own decisions (order, retries, what is reported).

Both record what they were asked to change, in order, as tuples whose first element names the
call (``("patch_node", name, patch)``, ``("restart", unit)``). Pass one list as ``calls`` to both
to see the order across them. Reads are not in ``calls`` (``FakeKube.reads`` has them).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from node_agent.base.errors import KubeAlreadyExists, KubeConflict, KubeError, KubeNotFound
from node_agent.kube.api_errors import ObjectRef
from node_agent.kube.client import ClientStats
from node_agent.systemd import JobAction, JobResult, UnitFileChange, UnitState

if TYPE_CHECKING:
    from node_agent.config import NodeAgentConfiguration
    from node_agent.context import AgentContext
    from node_agent.kube.seam import KubeSeam, ResourceSeam
    from node_agent.systemd import SystemdSeam

JSON = dict[str, Any]
Call = tuple[Any, ...]


def merge_patch(target: JSON, patch: Mapping[str, Any]) -> None:
    """RFC 7386 in place: ``None`` deletes a key, maps merge, anything else replaces."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping):
            child = target.get(key)
            if not isinstance(child, dict):
                child = target[key] = {}
            merge_patch(child, value)
        else:
            target[key] = value


class FakeResource:
    """One collection of a ``FakeKube``: objects by name, stored as given and changed in place (a
    test can keep a reference to an object and see what the code under test did to it)."""

    def __init__(self, kube: FakeKube, kind: str, namespace: str | None) -> None:
        self.kube, self.kind, self.namespace = kube, kind, namespace
        self.items: dict[str, JSON] = {}
        self._history: list[tuple[int, JSON]] = []
        self._watchers: list[tuple[str | None, asyncio.Queue[tuple[int, JSON]]]] = []

    # -- test set-up ----------------------------------------------------------------------------

    def put(self, obj: JSON) -> JSON:
        """Add or replace an object (its ``metadata.name``); watchers see ADDED/MODIFIED."""
        name = obj["metadata"]["name"]
        self._notify("MODIFIED" if name in self.items else "ADDED", obj)
        self.items[name] = obj
        return obj

    def delete(self, name: str) -> None:
        """Remove an object; watchers see DELETED."""
        obj = self.items.pop(name)
        self._notify("DELETED", obj)

    # -- the ResourceSeam calls -----------------------------------------------------------------

    def ref(self, verb: str, name: str | None = None) -> ObjectRef:
        return ObjectRef(verb, self.kind, self.namespace, name)

    def _key(self, verb: str) -> str:
        return f"{self.kind}.{verb}"

    async def get(self, name: str) -> JSON:
        self.kube._read(self._key("get"), self.namespace, name)
        return self._existing("get", name)

    async def list(
        self,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
        metadata_only: bool = False,
    ) -> JSON:
        """The selected objects (a ``metadata.name=`` field selector, ``key=value`` label
        selectors joined by commas), a page of ``limit`` from ``continue_token`` at a time;
        ``metadata_only`` answers each object's metadata alone, as the server does."""
        self.kube._read(self._key("list"), self.namespace, field_selector or label_selector)
        items = [
            o
            for o in self.items.values()
            if _selected(o, field_selector) and _labelled(o, label_selector)
        ]
        start = int(continue_token or 0)
        end = len(items) if limit is None else start + limit
        page = items[start:end]
        if metadata_only:
            page = [{"metadata": o.get("metadata", {})} for o in page]
        meta: JSON = {"resourceVersion": str(self.kube.revision)}
        if end < len(items):
            meta["continue"] = str(end)
        return {"items": page, "metadata": meta}

    async def watch(
        self,
        *,
        resource_version: str,
        field_selector: str | None = None,
        label_selector: str | None = None,
        timeout_seconds: int,
        read_timeout: float,
    ) -> AsyncGenerator[JSON, None]:
        """Changes made by ``put``/``delete`` and the write calls after ``resource_version`` (a
        revision of this fake), as the server keeps them; ends after ``timeout_seconds`` like the
        server's own timeout."""
        self.kube._read(self._key("watch"), self.namespace, field_selector)
        queue: asyncio.Queue[tuple[int, JSON]] = asyncio.Queue()
        for revision, event in self._history:
            if revision > int(resource_version):
                queue.put_nowait((revision, event))
        entry = (field_selector, queue)
        self._watchers.append(entry)
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        try:
            while True:
                left = deadline - asyncio.get_running_loop().time()
                try:
                    async with asyncio.timeout(max(left, 0.0)):
                        revision, event = await queue.get()
                except TimeoutError:
                    return
                if _selected(event["object"], field_selector):
                    yield event
        finally:
            self._watchers.remove(entry)

    async def create(self, body: Mapping[str, Any]) -> JSON:
        name = str(body["metadata"]["name"])
        self.kube._write(self._key("create"), self.namespace, name, body)
        if name in self.items:
            raise KubeAlreadyExists(f"{self.ref('create', name)}: exists", status=409)
        obj = dict(body)
        # as the server does: a created object has a resourceVersion (a later PUT is a CAS)
        obj["metadata"] = {"resourceVersion": str(self.kube.revision + 1), **obj["metadata"]}
        if self.kube.on_create is not None:
            obj = self.kube.on_create(self.kind, obj)
        return self.put(obj)

    async def replace(self, name: str, body: Mapping[str, Any]) -> JSON:
        self.kube._write(self._key("replace"), self.namespace, name, body)
        current = self._existing("update", name)
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current.get("metadata", {}).get("resourceVersion"):
            raise KubeConflict(f"{self.ref('update', name)}: modified meanwhile", status=409)
        obj = dict(body)
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.kube.revision + 1)}
        return self.put(obj)

    async def merge_patch(self, name: str, patch: Mapping[str, Any]) -> JSON:
        self.kube._write(self._key("patch"), self.namespace, name, patch)
        return self._patch(name, patch)

    # -- inside ---------------------------------------------------------------------------------

    def _existing(self, verb: str, name: str) -> JSON:
        if name not in self.items:
            ref = self.ref(verb, name)
            raise KubeNotFound(f"{ref}: not found", status=404, reason="NotFound")
        return self.items[name]

    def _patch(self, name: str, patch: Mapping[str, Any]) -> JSON:
        obj = self._existing("patch", name)
        merge_patch(obj, patch)
        self._notify("MODIFIED", obj)
        return obj

    def _notify(self, kind: str, obj: JSON) -> None:
        self.kube.revision += 1
        change = (self.kube.revision, {"type": kind, "object": obj})
        self._history.append(change)
        for _, queue in self._watchers:
            queue.put_nowait(change)


def _selected(obj: JSON, field_selector: str | None) -> bool:
    if not field_selector or not field_selector.startswith("metadata.name="):
        return True
    name = field_selector.removeprefix("metadata.name=")
    return bool(obj.get("metadata", {}).get("name") == name)


def _labelled(obj: JSON, label_selector: str | None) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in (label_selector or "").split(","):
        if term:
            key, _, value = term.partition("=")
            if labels.get(key) != value:
                return False
    return True


class FakeKube:
    """An in-memory API server behind the ``KubeSeam`` calls.

    - Objects live in collections: ``kube.nodes().put(node)``, ``kube.secrets(ns).put(secret)``;
      a missing one answers 404 (``KubeNotFound``), like the server.
    - ``calls`` records every write in order (``("patch_node", name, patch)``,
      ``("create_event", body)``, ``("Lease.create", namespace, name, body)`` ...), ``reads``
      every read the same way.
    - ``fail(call, error, times)`` makes the next ``times`` calls of that name raise ``error``.
    - ``on_create(kind, obj) -> obj`` may complete created objects (e.g. issue a certificate).
    """

    def __init__(
        self,
        *,
        server: str = "https://api.example:6443",
        stats: ClientStats | None = None,
        calls: list[Call] | None = None,
        on_create: Callable[[str, JSON], JSON] | None = None,
    ) -> None:
        self.server = server
        self.stats = stats if stats is not None else ClientStats()
        self.calls: list[Call] = calls if calls is not None else []
        self.reads: list[Call] = []
        self.on_create = on_create
        self.closed = False
        self.revision = 1
        self._collections: dict[tuple[str, str | None], FakeResource] = {}
        self._failures: dict[str, list[KubeError]] = {}

    def fail(self, call: str, error: KubeError, times: int = 1) -> None:
        """The next ``times`` calls named ``call`` (as recorded) raise ``error``."""
        self._failures.setdefault(call, []).extend([error] * times)

    def writes(self, call: str) -> list[Call]:
        """The recorded writes named ``call``."""
        return [c for c in self.calls if c[0] == call]

    def _check(self, call: str) -> None:
        pending = self._failures.get(call)
        if pending:
            raise pending.pop(0)

    def _read(self, call: str, *args: Any) -> None:
        self._check(call)
        self.reads.append((call, *args))

    def _write(self, call: str, *args: Any) -> None:
        self._check(call)
        self.calls.append((call, *args))

    def _collection(self, kind: str, namespace: str | None) -> FakeResource:
        key = (kind, namespace)
        if key not in self._collections:
            self._collections[key] = FakeResource(self, kind, namespace)
        return self._collections[key]

    # -- the KubeSeam calls ---------------------------------------------------------------------

    async def close(self) -> None:
        self.closed = True

    def nodes(self) -> FakeResource:
        return self._collection("Node", None)

    def secrets(self, namespace: str) -> FakeResource:
        return self._collection("Secret", namespace)

    def leases(self, namespace: str) -> FakeResource:
        return self._collection("Lease", namespace)

    def events(self, namespace: str) -> FakeResource:
        return self._collection("Event", namespace)

    def certificate_signing_requests(self) -> FakeResource:
        return self._collection("CertificateSigningRequest", None)

    async def get_node(self, name: str) -> JSON:
        self._read("get_node", name)
        return self.nodes()._existing("get", name)

    async def patch_node(self, name: str, patch: Mapping[str, Any]) -> JSON:
        self._write("patch_node", name, patch)
        return self.nodes()._patch(name, patch)

    async def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> JSON:
        self._write("patch_node_status", name, patch)
        return self.nodes()._patch(name, {"status": patch.get("status", {})})

    async def patch_node_condition(self, name: str, condition: Mapping[str, Any]) -> JSON:
        """As the API server's strategic merge on ``status.conditions`` (key ``type``)."""
        self._write("patch_node_condition", name, condition)
        node = self.nodes()._existing("patch", name)
        listed = [c for c in (node.get("status") or {}).get("conditions") or []]
        merged = [dict(condition) if c.get("type") == condition["type"] else c for c in listed]
        if all(c.get("type") != condition["type"] for c in listed):
            merged.append(dict(condition))
        return self.nodes()._patch(name, {"status": {"conditions": merged}})

    async def get_secret(self, namespace: str, name: str) -> JSON:
        self._read("get_secret", namespace, name)
        return self.secrets(namespace)._existing("get", name)

    async def get_lease(self, namespace: str, name: str) -> JSON:
        self._read("get_lease", namespace, name)
        return self.leases(namespace)._existing("get", name)

    async def create_lease(self, namespace: str, body: Mapping[str, Any]) -> JSON:
        self._check("create_lease")
        return await self.leases(namespace).create(body)

    async def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> JSON:
        self._check("update_lease")
        return await self.leases(namespace).replace(name, body)

    async def create_event(self, body: Mapping[str, Any]) -> JSON:
        self._write("create_event", body)
        namespace = str(body.get("metadata", {}).get("namespace") or "default")
        events = self.events(namespace)
        name = str(body.get("metadata", {}).get("name") or f"event-{len(events.items)}")
        events.items[name] = dict(body)
        return events.items[name]

    def pods(self, namespace: str) -> FakeResource:
        return self._collection("Pod", namespace)

    async def list_pods_on_node(self, node: str) -> list[JSON]:
        self._read("list_pods_on_node", node)
        return [
            pod
            for (kind, _), pods in self._collections.items()
            if kind == "Pod"
            for pod in pods.items.values()
            if (pod.get("spec") or {}).get("nodeName") == node
        ]

    async def delete_pod(self, namespace: str, name: str) -> None:
        self._write("delete_pod", namespace, name)
        pods = self.pods(namespace)
        if name in pods.items:
            pods.delete(name)


def issue_certificates(sign: Callable[[bytes], bytes]) -> Callable[[str, JSON], JSON]:
    """An ``on_create`` for ``FakeKube``: every CertificateSigningRequest is approved and issued at
    once with ``sign(csr_pem) -> certificate_pem``."""

    def on_create(kind: str, obj: JSON) -> JSON:
        if kind != "CertificateSigningRequest":
            return obj
        cert = sign(base64.b64decode(obj["spec"]["request"]))
        name = obj["metadata"]["name"]
        return {
            **obj,
            "metadata": {**obj["metadata"], "uid": name},
            "status": {
                "conditions": [{"type": "Approved"}],
                "certificate": base64.b64encode(cert).decode(),
            },
        }

    return on_create


ACTIVE = ("active", "running")
INACTIVE = ("inactive", "dead")
FAILED = ("failed", "failed")


class OneJobUnits:
    """``start_unit``/``stop_unit``/``restart_unit`` as a ``run_jobs`` of that one job, for the
    systemd stand-ins (``FakeSystemd`` and the apply machine's model) to share."""

    async def run_jobs(
        self, jobs: Sequence[tuple[str, JobAction]], *, job_timeout: float = 10.0
    ) -> dict[str, JobResult]:
        raise NotImplementedError

    async def start_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        return (await self.run_jobs([(unit, "start")]))[unit]

    async def stop_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        return (await self.run_jobs([(unit, "stop")]))[unit]

    async def restart_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        return (await self.run_jobs([(unit, "restart")]))[unit]


class FakeSystemd(OneJobUnits):
    """systemd behind the ``SystemdSeam`` calls, in memory.

    - ``units``: the loaded units, name → (ActiveState, SubState); others are ``not-found``.
      ``enabled``: names whose unit file is enabled.
    - Jobs succeed unless their unit is in ``failing`` (then ``failed``, and the unit is failed)
      or in ``slow`` (a start/restart still running at the deadline: ``timeout``, unfinished, the
      unit activating); start/restart make a unit active, stop inactive. Each is recorded as
      ``(action, unit)`` in ``calls`` and in ``jobs``; ``enable``/``disable`` as
      ``("enable", *units)``, a reload as ``("daemon_reload",)``.
    - ``hang``: ``unit_states`` never answers (a stuck systemd).
    - ``props``: more ``UnitState`` fields per unit, e.g. ``{"service_type": "oneshot",
      "triggered_by": ("x.timer",), "state_change_timestamp": usec, "load_state": "masked"}``;
      a ``brief`` read leaves them out (except ``load_state``), as systemd's does.
    """

    def __init__(
        self,
        units: Mapping[str, tuple[str, str]] | None = None,
        *,
        enabled: Iterable[str] = (),
        failing: Iterable[str] = (),
        slow: Iterable[str] = (),
        hang: bool = False,
        calls: list[Call] | None = None,
    ) -> None:
        self.units: dict[str, tuple[str, str]] = dict(units or {})
        self.enabled = set(enabled)
        self.failing = set(failing)
        self.slow = set(slow)
        self.hang = hang
        self.calls: list[Call] = calls if calls is not None else []
        self.jobs: list[tuple[str, JobAction]] = []
        self.props: dict[str, dict[str, Any]] = {}
        self.started = self.closed = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def daemon_reload(self) -> None:
        self.calls.append(("daemon_reload",))

    async def enable(self, units: Sequence[str]) -> list[UnitFileChange]:
        """Like systemd: a symlink made for each unit not enabled before, none for the rest."""
        self.calls.append(("enable", *units))
        new = [u for u in dict.fromkeys(units) if u not in self.enabled]
        self.enabled.update(units)
        return [UnitFileChange("symlink", f"/etc/systemd/system/x.wants/{u}", "") for u in new]

    async def disable(self, units: Sequence[str]) -> list[UnitFileChange]:
        self.calls.append(("disable", *units))
        gone = [u for u in dict.fromkeys(units) if u in self.enabled]
        self.enabled.difference_update(units)
        return [UnitFileChange("unlink", f"/etc/systemd/system/x.wants/{u}", "") for u in gone]

    async def run_jobs(
        self, jobs: Sequence[tuple[str, JobAction]], *, job_timeout: float = 10.0
    ) -> dict[str, JobResult]:
        results = {}
        for unit, action in jobs:
            self.calls.append((action, unit))
            self.jobs.append((unit, action))
            if unit in self.failing:
                self.units[unit] = FAILED
                results[unit] = JobResult(unit, action, "failed")
            elif unit in self.slow and action != "stop":
                self.units[unit] = ("activating", "start")
                results[unit] = JobResult(unit, action, "timeout", finished=False, job="/job/1")
            else:
                self.units[unit] = INACTIVE if action == "stop" else ACTIVE
                results[unit] = JobResult(unit, action, "done")
        return results

    async def unit_states(
        self, names: Sequence[str], *, brief: bool = False
    ) -> dict[str, UnitState]:
        if self.hang:
            await asyncio.Event().wait()
        out = {}
        for name in names:
            active, sub = self.units.get(name, INACTIVE)
            fields: dict[str, Any] = {
                "load_state": "loaded" if name in self.units else "not-found",
                **self.props.get(name, {}),
            }
            if brief:  # like systemd's ListUnitsByNames: the states only
                fields = {k: v for k, v in fields.items() if k == "load_state"}
            out[name] = UnitState(
                name=name,
                id=name,
                active_state=active,
                sub_state=sub,
                unit_file_state=(
                    "" if brief else "enabled" if name in self.enabled else "disabled"
                ),
                invocation_id="",
                fragment_path="",
                drop_in_paths=(),
                **fields,
            )
        return out

    async def failed_units(self) -> list[str]:
        return sorted(n for n, (active, _) in self.units.items() if active == "failed")


if TYPE_CHECKING:
    # mypy proves the fakes fit the seams they stand in for.
    _kube: type[KubeSeam] = FakeKube
    _systemd: type[SystemdSeam] = FakeSystemd

    def _resource(resource: FakeResource) -> ResourceSeam:
        return resource


_Ctx = TypeVar("_Ctx", bound="AgentContext")
_KEEP: Any = object()  # "not given": the parameter's default part is built


def make_ctx(
    root: Path,
    *,
    config: NodeAgentConfiguration | Mapping[str, Any] | None = None,
    kube: FakeKube | None = None,
    systemd: FakeSystemd | None = None,
    state: Any = _KEEP,
    host_name: str = "n1",
    node_name: str | None = "n1",
    node_uid: str | None = "u1",
    context_type: type[_Ctx] | None = None,
    **settings: Any,
) -> _Ctx:
    """An ``AgentContext`` on fakes under ``root``: the one way unit tests build one.

    ``config`` is the component config (a mapping is validated as the file would be); ``state``
    may be any stand-in the code under test reads (default: a real ``StateStore`` under
    ``root``); ``settings`` go to ``AgentSettings``; ``context_type`` a subclass to build."""
    from node_agent.config import AgentSettings
    from node_agent.config import NodeAgentConfiguration as Config
    from node_agent.context import AgentContext
    from node_agent.host.fs import HostFS
    from node_agent.host.state import StateStore

    fs = HostFS(root)
    if not isinstance(config, Config):
        config = Config.model_validate(dict(config or {}))
    build: Any = context_type or AgentContext
    ctx: _Ctx = build(
        settings=AgentSettings(root=root, **settings),
        config=config,
        fs=fs,
        state=StateStore(fs) if state is _KEEP else state,
        systemd=systemd if systemd is not None else FakeSystemd(),
        kube=kube if kube is not None else FakeKube(),
        host_name=host_name,
        node_name=node_name,
        node_uid=node_uid,
    )
    return ctx


def osc_document(text: str, units: list[JSON]) -> JSON:
    """A small OSC: the one file ``/etc/test/a.conf`` holding ``text``, and ``units``, for the
    tests that only need some OSC the controller or status can apply and read back."""
    return {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "spec": {
            "type": "debian",
            "purpose": "reconcile",
            "files": [
                {"path": "/etc/test/a.conf", "permissions": 0o644,
                 "content": {"inline": {"data": text}}}
            ],
            "units": units,
        },
    }  # fmt: skip


class VirtualClock:
    """The running loop's clock while :func:`virtual_time` holds it: seconds that pass only
    when every task waits for a timer."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.jumped = 0.0  # seconds skipped in all

    def time(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def virtual_time() -> AsyncIterator[VirtualClock]:
    """Run the loop on a clock that jumps to its next timer whenever nothing is ready, so a test
    of timing (backoffs, periods, "nothing happens for a while") takes no wall time. The clock
    stands while the loop's worker threads work (the host seam's file calls): their work takes
    real time, which a jump would skip. A child process's work is not seen: not for tests that
    wait on one. The loop's ``time``, ``run_in_executor`` and its selector's ``select`` are
    replaced, and restored on exit (the unit tests share one loop)."""
    loop = asyncio.get_running_loop()
    selector = loop._selector  # type: ignore[attr-defined]
    real_select, real_run_in_executor = selector.select, loop.run_in_executor
    clock = VirtualClock(loop.time())
    in_threads: set[asyncio.Future[Any]] = set()

    def run_in_executor(executor: Any, func: Callable[..., Any], *args: Any) -> Any:
        future = real_run_in_executor(executor, func, *args)
        in_threads.add(future)
        future.add_done_callback(in_threads.discard)
        return future

    def select(timeout: float | None = None) -> Any:
        if in_threads:  # a worker thread's work takes real time: the clock stands meanwhile
            return real_select(timeout)
        events = real_select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer at all: only an outside event can wake the loop
            return real_select(None)
        clock.now += timeout
        clock.jumped += timeout
        return events

    loop.time = clock.time  # type: ignore[method-assign]
    loop.run_in_executor = run_in_executor  # type: ignore[method-assign,assignment]
    selector.select = select
    try:
        yield clock
    finally:
        selector.select = real_select
        del loop.time, loop.run_in_executor


async def until(done: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll ``done`` until it is true (the loop keeps turning meanwhile); the one poller of the
    unit tests (a timeout only ends a test that fails)."""
    async with asyncio.timeout(timeout):
        while True:
            if done():
                return
            await asyncio.sleep(0.01)
