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
"""

import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest


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


@contextlib.contextmanager
def worker(timeout: float = 300):
    """One spawned worker with TRITON_INTERPRET=1 -> run(fn, *args): fn(*args) there (fn and args picklable)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        executor = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), _patch_interpreter_scalars)
        executor.submit(int).result()  # starts the worker while the flag is set
    with executor:
        yield lambda fn, *args: executor.submit(fn, *args).result(timeout=timeout)
