"""`torch.manual_seed` in a rank thread seeds that rank's generators only, as it would in a process per rank.

torch's default CPU generator is one per process (`at::detail::getDefaultCPUGenerator()`, a static in
aten/src/ATen/CPUGeneratorImpl.cpp) and C++ has no per-thread override, so rank threads cannot each get one
inside torch. What threadpar does instead, while a launch runs:

- `torch.manual_seed` and `torch.seed` in a rank thread act on a CPU generator of the rank's own, made
  then (torch/random.py reads its module global `default_generator`, which is routed per thread here);
  `torch.get_rng_state`, `set_rng_state`, `initial_seed` (and so `torch.random.fork_rng`) act on it once
  it exists, on the process's before.
- From that first seeding call on, every random op the rank calls from Python on a CPU tensor without a
  `generator=` gets the rank's generator (a `TorchFunctionMode` of the rank thread, `RankRandomMode`): the
  ATen ops whose every overload takes a Generator (`uniform_`, `normal_`, `bernoulli_`, `multinomial`, ...),
  the factories (`rand`, `randn`, `randint`, `randperm` and their `_like` forms), Python functions with a
  `generator` parameter (`torch.nn.init.*`), and `torch.nn.functional.dropout` (nn.Dropout), which ATen
  runs on CPU as `empty_like(x).bernoulli_(1 - p).div_(1 - p)` and `x * noise` (aten/src/ATen/native/
  Dropout.cpp, `_dropout_impl`): the same ops with the rank's generator, so the same numbers a process
  seeded alike draws.
- `torch.cuda.manual_seed_all` / `seed_all` in a rank on a GPU seed that rank's device only (each rank
  owns one; CUDA generators are per device).

What stays shared: random ops that C++ calls inside other ops without a generator argument
(`F.rrelu`, `alpha_dropout`, `feature_alpha_dropout`, `dropout1d/2d/3d`, a random op nested inside a
Python-level torch function the mode does not handle, such as `F.gumbel_softmax`), `torch.default_generator`
used directly, Python's `random` and numpy's global state. Draw those from an explicit generator
(`threadpar.get_generator()`, `torch.Generator().manual_seed(...)`). Before a rank's first seeding call its
random ops use the process's generator (no mode is pushed until then: the mode costs a Python call per torch
call on the rank thread).
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_local = threading.local()


def _generator_ops() -> frozenset[str]:
    """ATen ops whose every overload takes a Generator, plus the factories whose Python binding takes
    generator= in every form (rand, randn, randint, randperm, *_like)."""
    seen: dict[str, list[bool]] = {}
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.split("::")[-1]
        seen.setdefault(name, []).append(any("Generator" in str(a.type) for a in schema.arguments))
    names = {n for n, has in seen.items() if all(has)}
    names |= {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like"}
    return frozenset(names - {"manual_seed", "seed", "initial_seed", "inductor_reserve_rng_state"})


_GENERATOR_OPS = _generator_ops()
_BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType)


# func -> whether it takes generator=: a pure cache (a dict rather than lru_cache, which dynamo warns about
# when it traces the mode); two rank threads computing one entry both write the same value.
_TAKES_GENERATOR: dict[Any, bool] = {}


def _takes_generator(func: Callable[..., Any]) -> bool:
    known = _TAKES_GENERATOR.get(func)
    if known is None:
        if isinstance(func, _BUILTINS):
            known = getattr(func, "__name__", "") in _GENERATOR_OPS
        else:
            try:
                known = "generator" in inspect.signature(func).parameters
            except (TypeError, ValueError):
                known = False
        _TAKES_GENERATOR[func] = known
    return known


def _on_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether the op runs on CPU: its device= argument, else its first tensor's, else the default device."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type == "cpu"
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type == "cpu"
    tensor = kwargs.get("input", kwargs.get("tensor"))
    if isinstance(tensor, torch.Tensor):
        return tensor.device.type == "cpu"
    return torch.get_default_device().type == "cpu"


def _dropout(
    generator: torch.Generator,
    input: torch.Tensor,
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """F.dropout on CPU with `generator`: ATen's `_dropout_impl` for p in (0, 1), the same ops in order."""
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0 or p == 1.0 or input.numel() == 0:
        return F.dropout(input, p, training, inplace)  # no random numbers drawn
    noise = torch.empty_like(input).bernoulli_(1 - p, generator=generator)
    noise.div_(1 - p)
    return input.mul_(noise) if inplace else input * noise


class RankRandomMode(TorchFunctionMode):
    """In one rank thread: random ops on CPU without a generator draw from the rank's own."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = {} if kwargs is None else kwargs
        if func is F.dropout:
            if _on_cpu(args, kwargs):
                return _dropout(self.generator, *args, **kwargs)
        elif kwargs.get("generator") is None and _takes_generator(func) and _on_cpu(args, kwargs):
            kwargs = {**kwargs, "generator": self.generator}
        return func(*args, **kwargs)


def _push_at_bottom(mode: TorchFunctionMode) -> None:
    """Push `mode` under the thread's other torch function modes: a `with SomeMode():` open when the rank
    seeded pops its own mode, not this one, when it exits."""
    above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    torch._C._push_on_torch_function_stack(mode)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


def _remove(mode: TorchFunctionMode) -> None:
    above = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    for other in reversed(above):
        if other is not mode:
            torch._C._push_on_torch_function_stack(other)


class RankRandom:
    """One rank thread's random state: its CPU generator once it seeds, and the mode that routes to it."""

    def __init__(self, cuda_device: torch.device | None) -> None:
        self.cuda_device = cuda_device
        self.generator: torch.Generator | None = None
        self._mode: RankRandomMode | None = None

    def own(self) -> torch.Generator:
        """The rank's CPU generator, made (from the process's current state) and routed to on first use."""
        if self.generator is None:
            generator = torch.Generator()
            generator.set_state(_process_generator().get_state())
            self.generator = generator
            self._mode = RankRandomMode(generator)
            _push_at_bottom(self._mode)
        return self.generator

    def close(self) -> None:
        if self._mode is not None:
            _remove(self._mode)
            self._mode = None


def bind(state: RankRandom | None) -> None:
    """The calling thread's random state (None: the process's again); closes the one it replaces."""
    previous = getattr(_local, "state", None)
    if previous is not None and previous is not state:
        previous.close()
    _local.state = state


def bound() -> RankRandom | None:
    return getattr(_local, "state", None)


_ORIGINAL: dict[str, Any] = {}


def _process_generator() -> torch.Generator:
    return _ORIGINAL.get("default_generator", torch.random.default_generator)


class RoutedDefaultGenerator:
    """Stands in for torch/random.py's module global `default_generator`: a rank thread's own generator
    for the seeding calls, the process's otherwise."""

    def manual_seed(self, seed: int) -> torch.Generator:
        state = bound()
        return _process_generator().manual_seed(seed) if state is None else state.own().manual_seed(seed)

    def seed(self) -> int:
        state = bound()
        return _process_generator().seed() if state is None else state.own().seed()

    def set_state(self, new_state: torch.Tensor) -> torch.Generator:
        # Restoring a state does not make the rank's own generator: torch's code that saves and restores
        # the RNG around its work (dynamo's preserve_rng_state, around every compilation) must not push
        # the mode in the middle of it (dynamo guards the mode stack). Once the rank seeded, its own.
        return self._reading().set_state(new_state)

    def _reading(self) -> torch.Generator:
        state = bound()
        return _process_generator() if state is None or state.generator is None else state.generator

    def get_state(self) -> torch.Tensor:
        return self._reading().get_state()

    def initial_seed(self) -> int:
        return self._reading().initial_seed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reading(), name)


def _cuda_manual_seed_all(seed: int) -> None:
    state = bound()
    if state is None or state.cuda_device is None:
        _ORIGINAL["cuda.manual_seed_all"](seed)
    else:
        with torch.cuda.device(state.cuda_device):
            torch.cuda.manual_seed(seed)


def _cuda_seed_all() -> None:
    state = bound()
    if state is None or state.cuda_device is None:
        _ORIGINAL["cuda.seed_all"]()
    else:
        with torch.cuda.device(state.cuda_device):
            torch.cuda.seed()


class RandomRouting:
    """The counted installation of the routed seeding functions (one per process; `_lock`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    def install(self) -> None:
        import torch.cuda.random

        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            _ORIGINAL["default_generator"] = torch.random.default_generator
            _ORIGINAL["cuda.manual_seed_all"] = torch.cuda.manual_seed_all
            _ORIGINAL["cuda.seed_all"] = torch.cuda.seed_all
            torch.random.default_generator = RoutedDefaultGenerator()  # type: ignore[assignment]
            routed = {"manual_seed_all": _cuda_manual_seed_all, "seed_all": _cuda_seed_all}
            for module in (torch.cuda, torch.cuda.random):
                for name, function in routed.items():
                    setattr(module, name, function)

    def uninstall(self) -> None:
        import torch.cuda.random

        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            torch.random.default_generator = _ORIGINAL.pop("default_generator")
            originals = {name: _ORIGINAL.pop(f"cuda.{name}") for name in ("manual_seed_all", "seed_all")}
            for module in (torch.cuda, torch.cuda.random):
                for name, function in originals.items():
                    setattr(module, name, function)


ROUTING = RandomRouting()
