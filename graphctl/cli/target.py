"""What ``graphctl capture TARGET`` captures: the factory protocol.

``TARGET`` is ``module:factory`` (an importable module) or ``path/to/file.py:factory``. The
factory is called with keyword options and returns a :class:`CaptureTarget`::

    def make_target(*, device: str, max_batch: int, draft_len: int, **_) -> graphctl.CaptureTarget:
        model = MyModel().to(device)
        meta = MyMetadata(...)                   # declared with graphctl.register(...)
        state = graphctl.bind(meta)
        ids = torch.randint(0, vocab, (max_batch * (draft_len + 1),), device=device)
        meta.prepare(state, ...)                 # a batch of max_batch requests
        return graphctl.CaptureTarget(forward=model.decode_step, example=(ids, meta), state=state,
                                      inputs=[graphctl.StaticInput("input_ids", per_item=draft_len + 1)],
                                      params=model, name="MyModel.decode_step")

Options passed: ``device`` (``"cuda"`` or ``"cpu"``, from ``--backend``), ``max_batch`` and
``draft_len`` (from the command line). Accept ``**_`` so that options added later do not break
the factory. The example must hold ``max_batch`` batch items: the command captures from it and
runs the coverage pass on its first ``n`` items for every ``n`` up to the largest bucket.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any

from graphctl.errors import DeclarationError
from graphctl.graphs.target import CaptureTarget

__all__ = ["load_target"]


def _bad(spec: str, found: str, fix: str) -> DeclarationError:
    return DeclarationError(
        "capture target cannot be loaded",
        buffer=None,
        expected="module:factory or file.py:factory returning a CaptureTarget",
        found=f"{spec!r}: {found}",
        fix=fix,
    )


def load_target(spec: str, **options: Any) -> CaptureTarget:
    """Import ``spec`` (``module:factory`` or ``file.py:factory``), call the factory with
    ``options`` and check that it returned a :class:`CaptureTarget`."""
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise _bad(spec, "no ':factory' part", "name the factory: graphctl capture mypkg.engine:make_target")
    if "" not in sys.path and os.getcwd() not in sys.path:  # `python -m` has it; the console script does not
        sys.path.insert(0, os.getcwd())  # (as uvicorn and gunicorn do: a target next to where you stand)
    if mod_name.endswith(".py"):
        if not os.path.isfile(mod_name):
            raise _bad(spec, f"no file {mod_name}", "give a path that exists, relative to the current directory")
        sys.path.insert(0, os.path.dirname(os.path.abspath(mod_name)))
        modspec = importlib.util.spec_from_file_location(os.path.basename(mod_name)[:-3], mod_name)
        if modspec is None or modspec.loader is None:
            raise _bad(spec, f"{mod_name} is not a Python module", "give a .py file")
        module = importlib.util.module_from_spec(modspec)
        try:
            modspec.loader.exec_module(module)
        except Exception as exc:
            raise _bad(spec, f"importing it raised {type(exc).__name__}: {exc}", "fix the module") from exc
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as exc:
            raise _bad(spec, f"module {mod_name} not importable ({exc})",
                       "install the package, or pass a file path: path/to/engine.py:make_target") from exc
        except Exception as exc:  # the module itself raised while importing
            raise _bad(spec, f"importing it raised {type(exc).__name__}: {exc}", "fix the module") from exc
    factory = vars(module).get(attr)
    if not callable(factory):
        raise _bad(spec, f"{mod_name} has no callable {attr}", f"define def {attr}(**options) -> CaptureTarget")
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as exc:
        raise _bad(spec, f"{attr}() cannot take the options {sorted(options)} ({exc})",
                   f"define def {attr}(*, device, max_batch, draft_len, **more) -> CaptureTarget") from None
    except ValueError:  # no signature to check (a builtin): the call says
        pass
    try:
        target = factory(**options)
    except DeclarationError as exc:  # a CaptureTarget field the factory got wrong: its own fix applies
        raise _bad(spec, f"{attr}(): {exc.what} (found {exc.found})", exc.fix or "fix the factory") from exc
    except (Exception, SystemExit) as exc:  # SystemExit: its code would pass for one of graphctl's own
        raise _bad(spec, f"{attr}() raised {type(exc).__name__}: {exc}", "fix the factory") from exc
    if not isinstance(target, CaptureTarget):
        raise _bad(spec, f"{attr}() returned {type(target).__name__}", "return graphctl.CaptureTarget(...)")
    return target
