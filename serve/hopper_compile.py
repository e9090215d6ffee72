"""Triton kernels compiled for a Hopper GPU (sm_90) on any machine: the compiler needs no GPU.

`build_ir` runs the compiler's front end, whose checks the CPU interpreter does not make (a loop that re-binds a name
to a block of another shape runs under the interpreter and compiles nowhere). `resources` compiles all the way to a
cubin and reads what the kernel takes: a thread's registers, and stack for the values that did not fit in them, and a
program's shared memory (`compile_launch` gives the whole compiled kernel). All take a `Launch`: `launch_spec` makes
one from a kernel launch's arguments, specialized as the GPU's launcher specializes them, and `recorded_launches`
records those that Python code makes, on meta tensors, instead of running them.

    launches = recorded_launches(lambda: kernels.fused_linear(x, weight, ...))   # x, weight on the meta device
    [resources(launch) for launch in launches]                  # [Resources(registers, stack, shared)]
"""

import importlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from typing import NamedTuple


class Launch(NamedTuple):
    """One launch of a kernel, as the compiler sees it (hashable: launches compile once)."""

    module: str
    kernel: str  # its name in `module`
    signature: tuple  # (argument, Triton type: "*bf16", "i32", "fp32", "constexpr", ...) in order
    constexprs: tuple  # (argument, value) of the constexpr ones, and of integer arguments equal to 1
    aligned: tuple  # the pointer arguments 16-byte aligned and the integer ones divisible by 16
    options: tuple  # (option, value): num_warps, num_stages


def launch_spec(fn, arg_names: list[str], args: tuple, kwargs: dict) -> Launch:
    """The `Launch` of kernel `fn` (the Python function under the triton.jit) on `args` and `kwargs`, specialized as
    Triton's launcher specializes it: an integer 1 becomes a constant, and pointers aligned to 16 bytes and integers
    divisible by 16 are marked so, which is what lets the compiler vectorize a load and pipeline it through shared
    memory (without the marks the compiled kernel is another one: no copies in flight, other registers). A meta
    tensor's pointer counts as aligned, as a fresh allocation on a GPU is."""
    from triton.runtime.jit import mangle_type  # the launcher's own typing: "*bf16", "i32", "fp32", "constexpr"

    bound = dict(zip(arg_names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in arg_names}
    constexpr = {name for name, p in fn.__annotations__.items() if "constexpr" in str(p)}
    signature, constexprs, aligned = [], [], []
    for name in arg_names:
        value = bound[name]
        if name in constexpr:
            signature.append((name, "constexpr"))
            constexprs.append((name, value))
        elif isinstance(value, int) and not isinstance(value, bool) and value == 1:
            signature.append((name, "constexpr"))
            constexprs.append((name, 1))
        else:
            signature.append((name, mangle_type(value)))
            address = value.data_ptr() if hasattr(value, "data_ptr") else value
            if isinstance(address, int) and not isinstance(address, bool) and address % 16 == 0:
                aligned.append(name)
    options = tuple((k, kwargs[k]) for k in ("num_warps", "num_stages") if k in kwargs)
    return Launch(fn.__module__, fn.__qualname__, tuple(signature), tuple(constexprs), tuple(aligned), options)


def recorded_launches(call: Callable[[], object], module=None) -> set[Launch]:
    """The kernel launches `call()` makes of the triton.jit kernels of `module` (default `eyas.serve.kernels`),
    recorded instead of run; so `call` may pass meta tensors. Their launch options are a Hopper GPU's, whatever this
    machine is: programmatic dependent launch in the mode each launch takes there (`kernels.launch_options`). The
    kernels are back in place on return (they call each other by name, so they compile only then)."""
    from triton.runtime.jit import JITFunction

    from . import kernels

    if module is None:
        module = kernels
    launches = set()

    class Recorder:
        def __init__(self, kernel: JITFunction):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.add(
                launch_spec(self.kernel.fn, self.kernel.arg_names, args, kwargs))

    originals = {name: value for name, value in vars(module).items() if isinstance(value, JITFunction)}
    launches_dependents = kernels._launches_dependents
    try:
        kernels._launches_dependents = lambda device: True
        for name, kernel in originals.items():
            setattr(module, name, Recorder(kernel))
        call()
    finally:
        kernels._launches_dependents = launches_dependents
        for name, kernel in originals.items():
            setattr(module, name, kernel)
    return launches


def _compiled(launch: Launch):
    """(the kernel's source for the compiler, the sm_90 target, the backend)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    index = kernel.arg_names.index
    source = ASTSource(kernel, dict(launch.signature), {(index(k),): v for k, v in launch.constexprs},
                       {(index(k),): backend.parse_attr("D") for k in launch.aligned})
    return source, target, backend


def build_ir(launch: Launch) -> None:
    """Builds `launch` into Triton's IR for sm_90: raises the compiler's CompilationError (the kernel's source, line
    and message) where it does not compile. In a process whose kernels are compiled ones, not interpreted."""
    from triton._C.libtriton import ir

    source, target, backend = _compiled(launch)
    options = backend.parse_options(dict(launch.options))
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


class Resources(NamedTuple):
    registers: int  # a thread's (255 at most on Hopper)
    stack: int  # bytes of a thread's stack frame: the values spilled from registers when they run out
    shared: int  # bytes of shared memory a program asks (its stages of tiles); an SM holds 228 KB, 1 KB more a program


def compile_launch(launch: Launch):
    """`launch` compiled for sm_90: Triton's compiled kernel (its `asm` holds "ttgir", "ptx", "cubin", ...)."""
    import triton

    source, target, _ = _compiled(launch)
    return triton.compile(source, target=target, options=dict(launch.options))


def resources(launch: Launch) -> Resources:
    """Compiles `launch` for sm_90 and reads its registers and stack from the cubin (with the cuobjdump that the
    triton wheel carries beside ptxas), and its shared memory from the compiler's metadata."""
    import triton

    compiled = compile_launch(launch)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, f"no registers in cuobjdump's report of {launch.kernel}:\n{usage}"
    return Resources(int(found[1]), int(found[2]), compiled.metadata.shared)
