"""A fake AppleNeuralEngine.framework behind the `ane.framework` seam, for Linux tests.

It does what the decompiled framework does where anelm's rules depend on it, and checks
what anelm must get right:
- `unload` deletes the model's compile folder (-[_ANEInMemoryModel unloadWithQoS:error:]);
- `load` refuses a folder that is missing or does not hold the model's files, so a backend
  that forgets to re-create it fails here as it would on a Mac;
- aned keeps compiled programs by hex id across processes (`Aned`, shared between fakes
  that stand for two processes), and `compiledModelExists` reads it;
- every retained object is tracked in `live`, so leaks and double releases show;
- the NoCopy blobs it is handed are kept as addresses, not references (as NSData does), so
  a backend that lets one be freed is not saved by the fake.
It evaluates only the self-test's program (y = x + 0.5); anything else copies x to y.
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
from pathlib import Path

import numpy as np

from anelm.device.ane import SELF_TEST_MIL
from anelm.device.base import Surface
from anelm.device.ane.objc import ObjCError, buffer_address


class Aned:
    """The daemon's program cache: hex ids of compiled programs, outliving processes."""

    def __init__(self):
        self.programs: set[str] = set()


class FakeSurface(Surface):
    @property
    def released(self) -> bool:
        return self.nbytes == 0


class FakeFramework:
    def __init__(self, tmp: Path, aned: Aned | None = None):
        self.tmp, self.aned = Path(tmp), aned or Aned()
        self.live: dict[int, str] = {}  # retained object -> what it is
        self.models: dict[int, dict] = {}
        self.calls: list[tuple[str, str]] = []  # (call, hex id or "")
        self.fail_unloads = self.fail_compiles = self.fail_loads = 0  # how many of the next calls fail
        self.requests_made = 0
        self.received_weights: list[dict] = []  # per new_model: key -> (address, length)
        self._ids = itertools.count(0x1000)

    def _new(self, kind: str) -> int:
        obj = next(self._ids)
        self.live[obj] = kind
        return obj

    # ------------------------------------------------------------------ the seam
    def temporary_directory(self) -> str:
        return str(self.tmp)

    def new_model(self, mil_text: bytes, weights: dict) -> tuple[int, str]:
        self.received_weights.append({k: buffer_address(v) for k, v in weights.items()})
        h = hashlib.sha256(bytes(mil_text))
        for key in sorted(weights):
            h.update(key.encode() + hashlib.sha256(weights[key]).digest())
        ptr = self._new("model")
        self.models[ptr] = {"hex": h.hexdigest()[:32], "mil": bytes(mil_text), "loaded": False,
                            "blobs": {k: bytes(v) for k, v in weights.items()}, "loaded_blobs": None}
        return ptr, self.models[ptr]["hex"]

    def _folder(self, ptr: int) -> Path:
        return self.tmp / self.models[ptr]["hex"]

    def compiled_model_exists(self, ptr: int) -> bool:
        self.calls.append(("compiledModelExists", self.models[ptr]["hex"]))
        return self.models[ptr]["hex"] in self.aned.programs

    def compile(self, ptr: int) -> None:
        self.calls.append(("compile", self.models[ptr]["hex"]))
        if self.fail_compiles:
            self.fail_compiles -= 1
            raise ObjCError("compileWithQoS", "com.apple.appleneuralengine", -3, "Program compile failed")
        self.aned.programs.add(self.models[ptr]["hex"])

    def load(self, ptr: int) -> None:
        m, folder = self.models[ptr], self._folder(ptr)
        self.calls.append(("load", m["hex"]))
        if self.fail_loads:
            self.fail_loads -= 1
            raise ObjCError("loadWithQoS", "com.apple.appleneuralengine", -4, "load failed")
        if m["hex"] not in self.aned.programs:
            raise ObjCError("loadWithQoS", "com.apple.appleneuralengine", -4, "no compiled program")
        if not (folder / "model.mil").is_file() or (folder / "model.mil").read_bytes() != m["mil"]:
            raise ObjCError("loadWithQoS", "com.apple.appleneuralengine", -4, f"model files missing in {folder}")
        m["loaded_blobs"] = {k: (folder / k.removeprefix("@model_path/")).read_bytes() for k in m["blobs"]}
        m["loaded"] = True

    def unload(self, ptr: int) -> None:
        m = self.models[ptr]
        self.calls.append(("unload", m["hex"]))
        if self.fail_unloads:
            self.fail_unloads -= 1
            raise ObjCError("unloadWithQoS", "com.apple.appleneuralengine", -5, "unload failed")
        m["loaded"] = False
        shutil.rmtree(self._folder(ptr), ignore_errors=True)  # as the framework does

    def new_surface(self, nbytes: int) -> FakeSurface:
        return FakeSurface(nbytes)

    def owns(self, surface) -> bool:
        return isinstance(surface, FakeSurface)

    def new_request(self, inputs, outputs) -> int:
        self.requests_made += 1
        req = self._new("request")
        self.models.setdefault("requests", {})[req] = (list(inputs), list(outputs))
        return req

    def evaluate(self, ptr: int, req: int) -> None:
        m = self.models[ptr]
        assert m["loaded"] and self.live.get(req) == "request"
        ins, outs = self.models["requests"][req]
        x = ins[0].read(outs[0].nbytes).view(np.float16)
        y = x + np.float16(0.5) if m["mil"] == SELF_TEST_MIL.encode() else x
        outs[0].write(y.astype(np.float16))

    def release(self, *objs: int) -> None:
        for obj in objs:
            assert obj in self.live, f"released {obj:#x} twice, or never retained it"
            del self.live[obj]
