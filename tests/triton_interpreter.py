"""Runs test functions under Triton's CPU interpreter, in a fresh spawned process.

Triton picks the interpreter when a kernel is defined (module import, TRITON_INTERPRET=1), and another test
module may already have imported the kernels in this process, so CPU cases of Triton kernels run in one worker
spawned with the flag set. A test module uses it as a fixture:

    @pytest.fixture(scope="module")
    def interpreter():
        with triton_interpreter.worker() as run:
            yield run

    def test_x(interpreter):
        interpreter(check, case, "cpu")   # check(case, "cpu") in the worker; its exceptions re-raised here

The interpreter runs a kernel's Python without the compiler's type checks (a loop that re-binds a name to a
block of another shape compiles nowhere but runs here), so every launch the worker interprets is also built, here,
into Triton's IR for a Hopper GPU (sm_90, programmatic dependent launch on): the compiler's front end, which needs
no GPU, in the process where the kernels are compiled ones, not interpreted.
"""

import contextlib
import importlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

_LAUNCHES = []  # in the worker: the launches (`_launch`) of the function running


def _patch_interpreter_scalars():
    """Worker initializer. With numpy >= 2.4 the interpreter of triton <= 3.6 cannot use a loaded value as a loop
    bound (int() of a 1-element array raises; triton-lang/triton#9171): apply the upstream fix (squeeze)."""
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:  # a triton whose interpreter was reorganised (and fixed) since
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def _record_launches():
    """Worker initializer: every kernel launch the interpreter runs is noted in _LAUNCHES (`_launch`)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        _LAUNCHES.append(_launch(self.fn, self.arg_names, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded


def _start_worker():
    _patch_interpreter_scalars()
    _record_launches()


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1"}


def _launch(fn, arg_names: list[str], args: tuple, kwargs: dict) -> tuple:
    """(module, name, signature, constexprs, options) of a launch of the kernel `fn`: the Triton type of each
    argument ("*bf16", "i32", "constexpr", ...), the constexprs' values, and num_warps / num_stages."""
    bound = dict(zip(arg_names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in arg_names}
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    constexpr = {name for name, p in fn.__annotations__.items() if "constexpr" in str(p)}
    signature, constexprs = {}, {}
    for name in arg_names:
        value = bound[name]
        if name in constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        else:
            signature[name] = "fp32"
    if "PDL" in constexprs:  # as served on Hopper
        constexprs["PDL"] = True
    return fn.__module__, fn.__qualname__, signature, constexprs, options


def _run_recording(fn, *args):
    """In the worker: fn(*args) and the launches it made."""
    _LAUNCHES.clear()
    fn(*args)
    return list(_LAUNCHES)


def _build_for_hopper(launch: tuple, built: set) -> None:
    """Builds one launch (`_launch`) of a kernel into Triton's IR for sm_90, unless already `built`: raises the
    compiler's error (file, line and the message) where the kernel's code does not compile."""
    module, name, signature, constexprs, options = launch
    key = (module, name, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
    if key in built:
        return
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    kernel = getattr(importlib.import_module(module), name)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    parsed = backend.parse_options(options)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    source.make_ir(target, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(), context)
    built.add(key)


@contextlib.contextmanager
def worker(timeout: float = 300):
    """One spawned worker with TRITON_INTERPRET=1 -> run(fn, *args): fn(*args) there (fn and args picklable), then
    each kernel launch it made built for Hopper here (`_build_for_hopper`)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        executor = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _start_worker)
        executor.submit(int).result()  # starts the worker while the flag is set
    built = set()

    def run(fn, *args):
        for launch in executor.submit(_run_recording, fn, *args).result(timeout=timeout):
            _build_for_hopper(launch, built)

    with executor:
        yield run
