"""Runs test functions under Triton's CPU interpreter, in a fresh spawned process.

Triton picks the interpreter when a kernel is defined (module import, TRITON_INTERPRET=1), and another test
module may already have imported the kernels in this process, so CPU cases of Triton kernels run in one worker
spawned with the flag set. A test takes it as the `interpreter` fixture (tests/conftest.py, one worker a module):

    def test_x(interpreter):
        interpreter(check, case, "cpu")   # check(case, "cpu") in the worker; its exceptions re-raised here

The interpreter runs a kernel's Python without the compiler's type checks (a loop that re-binds a name to a
block of another shape compiles nowhere but runs here), so every launch the worker interprets is also built, here,
into Triton's IR for a Hopper GPU (sm_90, programmatic dependent launch on): the compiler's front end, which needs
no GPU, in the process where the kernels are compiled ones, not interpreted.
"""

import contextlib
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch.testing

from eyas.serve.hopper_compile import build_ir, launch_spec
from eyas.serve.kernels import EARLY

_TESTS = os.path.dirname(os.path.abspath(__file__))
_LAUNCHES = []  # in the worker: the launches (`hopper_compile.launch_spec`) of the function running


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
    """Worker initializer: every kernel launch the interpreter runs is noted in _LAUNCHES."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, grid, warmup, **kwargs):
        # Built as the served kernel under programmatic dependent launch (the interpreter runs it without), so that
        # the front end checks its waits too.
        served = {**kwargs, "PDL": kwargs["PDL"] or EARLY.value} if "PDL" in kwargs else kwargs
        _LAUNCHES.append(launch_spec(self.fn, self.arg_names, args, served))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded


def _start_worker():
    _patch_interpreter_scalars()
    _record_launches()


def _run_recording(fn, *args):
    """In the worker: fn(*args) and the launches it made."""
    _LAUNCHES.clear()
    fn(*args)
    return list(_LAUNCHES)


def _build_for_hopper(launch, built: set) -> None:
    """Builds one launch (`hopper_compile.launch_spec`) into Triton's IR for sm_90, unless already `built`."""
    if launch not in built:
        build_ir(launch)
        built.add(launch)


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


def raises_in_comparison(run, fn, *args) -> None:
    """Asserts that `run(fn, *args)` (a worker's) fails where its check compares: in a test's own assert or
    torch.testing's, not in an assert of eyas's code that a wrong kernel tripped before any comparison ran."""
    with pytest.raises(AssertionError) as caught:
        run(fn, *args)
    frames = re.findall(r'File "([^"]+)"', str(caught.value.__cause__))  # the worker's traceback
    assert frames and frames[-1].startswith((_TESTS, os.path.dirname(torch.testing.__file__))), caught.value.__cause__
