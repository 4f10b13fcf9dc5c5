"""What instrumentation did: modules and kernels instrumented, hook sites,
stores tracked, and the modules left alone with the reason."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from concordia.instrument.rewriter import RewriteResult


@dataclass
class ModuleRecord:
    name: str                      # where it came from ("cupy:RawModule", a file, a fatbin member)
    result: RewriteResult
    handle: object | None = None   # the loaded module (CuPy function.Module) when known

    def to_json(self) -> dict:
        return {"module": self.name, **self.result.to_json()}


@dataclass
class Skipped:
    name: str
    reason: str

    def to_json(self) -> dict:
        return {"module": self.name, "skipped": self.reason}


@dataclass
class Report:
    modules: list[ModuleRecord] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, rec: ModuleRecord) -> None:
        with self._lock:
            self.modules.append(rec)

    def skip(self, name: str, reason: str) -> None:
        with self._lock:
            self.skipped.append(Skipped(name, reason))

    @property
    def kernels(self) -> list[str]:
        return [k.name for m in self.modules for k in m.result.kernels]

    @property
    def hook_sites(self) -> int:
        return sum(m.result.hook_sites for m in self.modules)

    @property
    def stores_tracked(self) -> int:
        return sum(m.result.stores_tracked for m in self.modules)

    @property
    def stores_untracked(self) -> int:
        return sum(m.result.stores_untracked for m in self.modules)

    def find(self, kernel_name: str) -> ModuleRecord:
        """The most recently loaded module holding `kernel_name`."""
        from concordia.instrument.errors import InstrumentError

        for m in reversed(self.modules):
            if any(k.name == kernel_name for k in m.result.kernels):
                return m
        raise InstrumentError(f"no instrumented module holds kernel {kernel_name!r}",
                              hint="was it compiled before instrument.enable()?")

    def to_json(self) -> dict:
        return {
            "modules": [m.to_json() for m in self.modules],
            "skipped": [s.to_json() for s in self.skipped],
            "kernels": self.kernels,
            "hook_sites": self.hook_sites,
            "stores_tracked": self.stores_tracked,
            "stores_untracked": self.stores_untracked,
        }

    def summary(self) -> str:
        return (f"{len(self.modules)} modules, {len(self.kernels)} kernels, {self.hook_sites} exit "
                f"hook sites, {self.stores_tracked} stores tracked ({self.stores_untracked} untracked), "
                f"{len(self.skipped)} modules skipped")
