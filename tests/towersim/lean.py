"""``contextmanager`` and ``suppress`` for the simulator's processes.

contextlib's import (collections and functools with it) is about 3 ms of a
simulated call's 20, and the suite makes thousands of calls; these two are
all the simulator uses of it. They behave as contextlib's do for what the
simulator writes (a generator that yields once; an exception raised in the
``with`` block is thrown into it), and the type checker reads contextlib's.

Runs on Python >= 3.9 with the standard library only.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from contextlib import contextmanager, suppress
else:

    class _GeneratorContext:
        """What ``contextmanager`` returns: the generator's one ``yield`` is
        the body of the ``with``."""

        def __init__(self, gen):
            self._gen = gen

        def __enter__(self):
            try:
                return next(self._gen)
            except StopIteration:
                raise RuntimeError("generator didn't yield") from None

        def __exit__(self, typ, value, tb):
            if typ is None:
                try:
                    next(self._gen)
                except StopIteration:
                    return False
                raise RuntimeError("generator didn't stop")
            if value is None:
                value = typ()
            try:
                self._gen.throw(value)
            except StopIteration as exc:
                # the generator caught it: suppressed, unless it is the very
                # StopIteration the block raised
                return exc is not value
            except BaseException as exc:
                if exc is value:
                    exc.__traceback__ = tb
                    return False
                raise
            raise RuntimeError("generator didn't stop after throw()")

    def contextmanager(func):
        """contextlib.contextmanager, for a generator that yields once."""

        def helper(*args, **kwargs):
            return _GeneratorContext(func(*args, **kwargs))

        helper.__name__ = func.__name__
        helper.__doc__ = func.__doc__
        return helper

    class suppress:  # noqa: N801 - named as contextlib's
        """contextlib.suppress: the named exceptions end the block silently."""

        def __init__(self, *exceptions):
            self._exceptions = exceptions

        def __enter__(self):
            return None

        def __exit__(self, typ, value, tb):
            return typ is not None and issubclass(typ, self._exceptions)


__all__ = ["contextmanager", "suppress"]
