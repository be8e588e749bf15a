"""The typed seams hold: the CUDA double and the real CudaApi, and every backend, match their Protocols; every
module imports only from its own layer of DESIGN.md's table or below, no backend reaches into another backend's
modules, and the package has no import cycle (function-level imports included)."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
from fakes.fake_cuda_nccl import FakeCuda, FakeNccl
from fakes.sim_gpu import CopyModel

import threadpar.comm
from threadpar.comm.backend import Backend
from threadpar.comm.common.cuda_seam import CudaApi, NcclApi, NcclRuntime
from threadpar.comm.hierarchical.group import HierarchicalGroup
from threadpar.comm.nccl.cuda_api import LibraryNcclRuntime, TorchCuda, nccl_runtime, torch_cuda
from threadpar.comm.nccl.group import NcclGroup
from threadpar.comm.nccl.library import NcclLibrary
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


@pytest.mark.parametrize(
    ("protocol", "implementation"),
    [
        (CudaApi, TorchCuda),
        (CudaApi, FakeCuda),
        (NcclRuntime, LibraryNcclRuntime),
        (NcclRuntime, FakeCuda),
        (NcclApi, NcclLibrary),
        (NcclApi, FakeNccl),
        (CopyModel, FakeCuda),  # (the double's own seam: its device's host <-> device copies on the streams)
    ],
    ids=lambda c: c.__name__,
)
def test_cuda_seam_implementations_have_every_protocol_method_with_its_parameters(protocol, implementation):
    methods = protocol_methods(protocol)
    assert methods, f"the {protocol.__name__} Protocol lists no methods"
    for name in methods:
        assert hasattr(implementation, name), f"{implementation.__name__} lacks {protocol.__name__}.{name}"
        assert parameters(getattr(implementation, name)) == parameters(getattr(protocol, name)), (
            f"{implementation.__name__}.{name}{inspect.signature(getattr(implementation, name))} differs from "
            f"{protocol.__name__}.{name}{inspect.signature(getattr(protocol, name))}"
        )


def test_the_double_and_the_real_seams_have_the_same_attributes_and_signatures():
    double = FakeCuda()
    for protocol, real in ((CudaApi, torch_cuda()), (NcclRuntime, nccl_runtime())):
        for api in (real, double):
            if not (
                protocol is NcclRuntime and api is real
            ):  # (isinstance reads `nccl`, which loads libnccl)
                assert isinstance(api, protocol)
            for attribute in protocol_attributes(protocol):  # (on the class: the real `nccl` loads libnccl)
                has = attribute in vars(api) or hasattr(type(api), attribute)
                assert has, f"{type(api).__name__} lacks {protocol.__name__}.{attribute}"
        for name in protocol_methods(protocol):
            assert parameters(getattr(real, name)) == parameters(getattr(double, name)), name


def test_cuda_primitives_and_the_nccl_runtime_are_separate_seams():
    """The real CUDA primitives carry no NCCL state (the threads backend's stream order needs only them), and
    the two Protocols share no member."""
    assert not isinstance(torch_cuda(), NcclRuntime)
    assert nccl_runtime().cuda is torch_cuda()
    shared = set(protocol_methods(CudaApi) + protocol_attributes(CudaApi)) & set(
        protocol_methods(NcclRuntime) + protocol_attributes(NcclRuntime)
    )
    assert not shared


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


def test_no_backend_imports_another_backend():
    """What backends share lives in comm/common (nccl's spanning groups once carried host transfers on a
    HierarchicalGroup; every op is NCCL's own now, and the message router comes with the launch's Processes)."""
    for backend in BACKENDS:
        for path in (COMM / backend).rglob("*.py"):
            for module, names in imported_modules(path):
                for other in BACKENDS:
                    assert other == backend or not module.startswith(f"threadpar.comm.{other}"), (
                        f"comm/{backend}/{path.name} imports {names or module} from {module}"
                    )


PACKAGE = pathlib.Path(threadpar.__file__).parent
DESIGN = PACKAGE.parent / "DESIGN.md"

# DESIGN.md's layer table, bottom to top: a module may import from its own layer and the layers below it.
# Each entry is a path under threadpar/ (a module, or a package with a trailing slash); the longest match places a
# module, and "" (the rest of the package) is the top layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors.py", "topology.py"),
    ("comm/common/",),
    ("comm/backend.py",),
    ("comm/threads/", "comm/nccl/", "comm/hierarchical/"),
    ("comm/",),
    ("torch_dist/",),
    ("runtime/",),
    ("cuda_graphs/",),
    ("parallel/",),
    ("pipeline/",),
    ("checkpoint.py",),
    ("models/",),
    ("",),  # demo/, testing/, run/, selftest.py, the package's __init__
)


def module_name(path: pathlib.Path) -> str:
    parts = ["threadpar", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def threadpar_imports(name: str) -> set[str]:
    """The threadpar modules `name` imports anywhere in its file (top level, in functions, under TYPE_CHECKING):
    `from package import module` counts as the module, `from module import name` as the module."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(name: str) -> int:
    path = MODULES[name].relative_to(PACKAGE).as_posix()
    best, length = len(LAYERS) - 1, -1
    for index, entries in enumerate(LAYERS):
        for entry in entries:
            if (path == entry or (entry.endswith("/") and path.startswith(entry)) or entry == "") and len(
                entry
            ) > length:
                best, length = index, len(entry)
    return best


def design_layer_paths() -> set[str]:
    """The paths in the first column of DESIGN.md's layer table (a line's text before two spaces)."""
    block = DESIGN.read_text().split("## Layers and the direction of dependencies", 1)[1].split("```")[1]
    paths: set[str] = set()
    for line in block.splitlines():
        first = line.split("  ", 1)[0]
        paths |= {word for word in first.split() if word.endswith((".py", "/"))}
    return paths


def test_the_layer_table_here_is_design_mds():
    """Every path of DESIGN.md's layer table is placed here, and every path placed here is named there."""
    here = {entry for entries in LAYERS for entry in entries if entry}
    named = design_layer_paths()
    assert here == named - {"demo/", "testing/", "run/", "selftest.py"}, here ^ named


def test_every_module_imports_only_from_its_layer_or_below():
    """DESIGN.md's whole layer table, function-level imports included (e.g. comm never imports the runtime)."""
    upward = [
        f"{name} ({'/'.join(LAYERS[layer_of(name)]) or 'top'}) imports {target} "
        f"({'/'.join(LAYERS[layer_of(target)]) or 'top'})"
        for name in sorted(MODULES)
        for target in sorted(threadpar_imports(name))
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, "imports against the layer table:\n" + "\n".join(upward)


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan's algorithm)."""
    graph = {name: threadpar_imports(name) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return cycles


def test_the_package_has_no_import_cycle():
    """No two modules import each other, directly or around a loop, not even from inside a function (a lazy
    import hides a cycle from the interpreter, not from the reader)."""
    assert import_cycles() == []


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    """The check above can fail: a module that imports its importer is a cycle."""
    real = threadpar_imports

    def with_a_loop(name: str) -> set[str]:
        extra = {"threadpar.comm.group"} if name == "threadpar.errors" else set()
        return real(name) | extra

    monkeypatch.setitem(globals(), "threadpar_imports", with_a_loop)
    assert any("threadpar.errors" in cycle for cycle in import_cycles())
