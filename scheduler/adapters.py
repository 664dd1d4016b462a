"""The LoRA adapters one engine replica serves, as the scheduler numbers them.

Every adapter the ranks hold has an id, never reused: the ``--lora-modules`` are 1..n
(the ranks register those at start-up in the same order), runtime loads take the next.
A request names an adapter; the scheduler resolves the name once, on arrival, and the
request keeps that id for its life: it keys the request's prefix-cache blocks (so a
block computed under one adapter never serves another, or the base model) and travels
to the ranks with the request's first chunk (``StepPlan.new_adapters``).

Loading: ``LoadAdapter`` goes to every rank on the plan socket, in order with the
plans; the name is served only once rank 0 answers that every rank holds it. Unloading
takes the name away at once (new requests for it get a 404), lets the requests that
hold the id finish on it, and drops it from the ranks when the last one has gone;
``replace`` swaps a name to a freshly loaded adapter the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.topology import LoraSpec
from protocol import ipc


@dataclass
class Adapter:
    adapter_id: int
    info: ipc.LoraAdapterInfo
    users: int = 0  # requests holding this id (waiting or running)
    served: bool = True  # False once unloaded or replaced: it only finishes its requests


class AdapterRegistry:
    def __init__(self, spec: LoraSpec, replica: int = 0) -> None:
        self.spec = spec
        self.replica = replica
        self.by_id: dict[int, Adapter] = {}
        self.served: dict[str, Adapter] = {}
        self.loading: dict[int, tuple[ipc.AdapterLoad, Adapter]] = {}
        for i, module in enumerate(spec.modules, start=1):
            self._serve(Adapter(i, ipc.LoraAdapterInfo(module.name, module.resolved_path(),
                                                       module.base_model_name or "")))
        self.next_id = len(spec.modules) + 1

    @property
    def enabled(self) -> bool:
        return self.spec.enabled

    def _serve(self, adapter: Adapter) -> None:
        self.by_id[adapter.adapter_id] = adapter
        self.served[adapter.info.name] = adapter

    def infos(self) -> list[ipc.LoraAdapterInfo]:
        return [a.info for a in self.served.values()]

    def _reply(self, msg, status: int, message: str = "", param: str | None = None,
               code: str | None = None, in_flight: int = 0) -> ipc.AdapterReply:
        return ipc.AdapterReply(msg.rid, self.replica, status, message, param, code, in_flight)

    # ------------------------------------------------------------------ requests

    def acquire(self, name: str) -> int | None:
        """The id a new request for adapter ``name`` holds, or None: not served."""
        adapter = self.served.get(name)
        if adapter is None:
            return None
        adapter.users += 1
        return adapter.adapter_id

    def release(self, adapter_id: int) -> int | None:
        """A request holding ``adapter_id`` ended; the id to drop from the ranks when that
        was the last user of an adapter no longer served."""
        adapter = self.by_id.get(adapter_id)
        if adapter is None:
            return None
        adapter.users -= 1
        return self._retire_if_idle(adapter)

    def _retire_if_idle(self, adapter: Adapter) -> int | None:
        if adapter.served or adapter.users > 0:
            return None
        del self.by_id[adapter.adapter_id]
        return adapter.adapter_id

    # ------------------------------------------------------------------ load / unload

    def start_load(self, msg: ipc.AdapterLoad) -> tuple[Adapter | None, ipc.AdapterReply | None]:
        """(the adapter for the ranks to load, or the refusal)."""
        if not self.enabled:
            return None, self._reply(msg, 400, "LoRA is not enabled on this engine (--enable-lora)",
                                     None, "lora_disabled")
        if msg.name in self.served and not msg.replace:
            return None, self._reply(msg, 400, f"The lora adapter {msg.name!r} has already been "
                                     "loaded (unload it first, or send load_inplace: true)",
                                     "lora_name", "lora_already_loaded")
        if any(load.name == msg.name for load, _ in self.loading.values()):
            return None, self._reply(msg, 409, f"The lora adapter {msg.name!r} is being loaded "
                                     "by another request", "lora_name", "lora_loading")
        adapter = Adapter(self.next_id, ipc.LoraAdapterInfo(msg.name, msg.path, msg.parent))
        self.next_id += 1
        self.loading[adapter.adapter_id] = (msg, adapter)
        return adapter, None

    def finish_load(self, loaded: ipc.AdapterLoaded) -> tuple[ipc.AdapterLoad | None, ipc.AdapterReply | None, int | None]:
        """(the load it answers, the reply for its frontend, an id to drop: the adapter it
        replaced, when idle)."""
        entry = self.loading.pop(loaded.adapter_id, None)
        if entry is None:
            return None, None, None
        msg, adapter = entry
        if loaded.error:
            return msg, self._reply(msg, 400, loaded.error, "lora_path", "invalid_lora_adapter"), None
        old = self.served.get(adapter.info.name)
        self._serve(adapter)
        drop = None
        if old is not None:
            old.served = False
            drop = self._retire_if_idle(old)
        return msg, self._reply(msg, 200), drop

    def unload(self, msg: ipc.AdapterUnload) -> tuple[ipc.AdapterReply, int | None]:
        """(the reply, an id to drop now)."""
        adapter = self.served.pop(msg.name, None)
        if adapter is None:
            names = ", ".join(repr(n) for n in self.served) or "none"
            return self._reply(msg, 404, f"The lora adapter {msg.name!r} cannot be found. "
                               f"Served adapters: [{names}]", "lora_name", "lora_not_found"), None
        adapter.served = False
        return (self._reply(msg, 200, in_flight=adapter.users), self._retire_if_idle(adapter))
