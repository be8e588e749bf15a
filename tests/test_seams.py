"""The typed seams hold: the CUDA double and the real CudaApi, and every backend, match their Protocols; the comm
package never imports the runtime, and no backend reaches into another backend's modules."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
from fakes.fake_cuda_nccl import FakeCuda

import threadpar.comm
from threadpar.comm.backend import Backend
from threadpar.comm.common.cuda_seam import CudaApi
from threadpar.comm.hierarchical.group import HierarchicalGroup
from threadpar.comm.nccl.cuda_api import TorchCuda, torch_cuda
from threadpar.comm.nccl.group import NcclGroup
from threadpar.comm.nccl.spanning import NcclSpanningGroup
from threadpar.comm.threads.group import ThreadsGroup

COMM = pathlib.Path(threadpar.comm.__file__).parent
BACKENDS = ("threads", "nccl", "hierarchical")


def protocol_methods(protocol: type) -> list[str]:
    return sorted(n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_"))


def protocol_attributes(protocol: type) -> list[str]:
    properties = [n for n, v in vars(protocol).items() if isinstance(v, property)]
    return sorted([*getattr(protocol, "__annotations__", {}), *properties])


def parameters(function) -> list[tuple[str, object, object]]:
    """(name, kind, default) of every parameter: what a caller relies on. Annotations are left out on
    purpose: the double's streams and events are its own classes, not torch.cuda's."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("implementation", [TorchCuda, FakeCuda], ids=lambda c: c.__name__)
def test_cuda_api_implementations_have_every_protocol_method_with_its_parameters(implementation):
    methods = protocol_methods(CudaApi)
    assert methods, "the CudaApi Protocol lists no methods"
    for name in methods:
        assert hasattr(implementation, name), f"{implementation.__name__} lacks CudaApi.{name}"
        assert parameters(getattr(implementation, name)) == parameters(getattr(CudaApi, name)), (
            f"{implementation.__name__}.{name}{inspect.signature(getattr(implementation, name))} differs from "
            f"CudaApi.{name}{inspect.signature(getattr(CudaApi, name))}"
        )


def test_the_double_and_the_real_cuda_api_are_cuda_apis_with_the_same_attributes():
    real, double = torch_cuda(), FakeCuda()
    for api in (real, double):
        assert isinstance(api, CudaApi)
        for attribute in protocol_attributes(CudaApi):
            assert hasattr(api, attribute), f"{type(api).__name__} lacks CudaApi.{attribute}"
    for name in protocol_methods(CudaApi):
        assert parameters(getattr(real, name)) == parameters(getattr(double, name)), name


@pytest.mark.parametrize(
    "backend", [ThreadsGroup, NcclGroup, NcclSpanningGroup, HierarchicalGroup], ids=lambda c: c.__name__
)
def test_every_backend_implements_the_backend_protocol(backend):
    methods = protocol_methods(Backend)
    assert len(methods) >= 12 and sorted(protocol_attributes(Backend)) == ["backend_name", "stream_ordered"]
    for name in methods:
        assert hasattr(backend, name), f"{backend.__name__} lacks Backend.{name}"
        assert parameters(getattr(backend, name)) == parameters(getattr(Backend, name)), (
            f"{backend.__name__}.{name}{inspect.signature(getattr(backend, name))} differs from "
            f"Backend.{name}{inspect.signature(getattr(Backend, name))}"
        )
    assert isinstance(backend.stream_ordered, bool) and isinstance(backend.backend_name, str)


def imported_modules(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) of every import in a file, function-level ones included."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_comm_never_imports_the_runtime():
    """The dependency arrow points one way: threadpar.runtime builds on threadpar.comm (no import cycle)."""
    for path in COMM.rglob("*.py"):
        for module, _ in imported_modules(path):
            assert not module.startswith("threadpar.runtime"), f"{path.relative_to(COMM)} imports {module}"


def test_no_backend_imports_another_backends_helpers():
    """A backend may build on another's public group class (nccl's spanning groups carry their host transfers
    on a HierarchicalGroup), never on its helpers: what backends share lives in comm/common."""
    allowed = {("nccl", "threadpar.comm.hierarchical.group"): {"HierarchicalGroup", "group_key"}}
    for backend in BACKENDS:
        for path in (COMM / backend).rglob("*.py"):
            for module, names in imported_modules(path):
                for other in BACKENDS:
                    if other != backend and module.startswith(f"threadpar.comm.{other}"):
                        permitted = allowed.get((backend, module), set())
                        assert names and set(names) <= permitted, (
                            f"comm/{backend}/{path.name} imports {names or module} from {module}"
                        )
