"""Every environment knob graphctl reads, defined in one place.

This module imports only the standard library: ``setup.py`` loads it by path to read the
build knobs without importing torch or the package. Values are parsed once, at import; an
invalid value raises at once, naming the variable (never silently ignored). Tests and users
override knobs for a region with :func:`scope`, never by mutating ``os.environ`` later.

The table in ``docs/knobs.md`` is generated from :data:`KNOBS` (``python -m graphctl.knobs``)
and checked against it by ``tests/unit/test_knobs_and_extension.py``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["KNOBS", "Knob", "knobs", "scope", "markdown_table", "env_of"]


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected one of 1/0/true/false/yes/no/on/off, found {raw!r}")


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        val = raw.strip().lower()
        if val not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, found {raw!r}")
        return val

    return parse


@dataclasses.dataclass(frozen=True, slots=True)
class Knob:
    """One environment variable: its attribute name, parser, default and meaning."""

    attr: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    when: str  # "runtime", "build" or "test"
    doc: str


KNOBS: tuple[Knob, ...] = (
    Knob("check_stale", "GRAPHCTL_CHECK_STALE", _parse_bool, False, "runtime",
         "Before every switch (and in `BoundState.check()`), recompute each derived buffer into "
         "scratch and raise `StaleBufferError` if the live buffer differs. Costs one extra "
         "recompute and a host sync per derived buffer; never applied inside a capture."),
    Knob("check_lengths", "GRAPHCTL_CHECK_LENGTHS", _parse_bool, False, "runtime",
         "Refuse a negative length where a token map reads lengths: `write()` of a buffer an `OpCall` "
         "`token_to_request_` reads as `seq_lens` raises `SwitchError` naming it, nothing written; "
         "`graphctl.ops.token_to_request_` raises `ValueError`. Off, a negative length counts as 0 in "
         "every kernel. Costs a host sync per checked value on a GPU."),
    Knob("verify_restore", "GRAPHCTL_VERIFY_RESTORE", _parse_bool, False, "runtime",
         "Fingerprint every snapshotted buffer on switch entry and again after restore; a "
         "difference poisons the state (`CorruptedStateError`). Host sync; skipped in capture."),
    Knob("check_manifest", "GRAPHCTL_CHECK_MANIFEST", _parse_bool, False, "runtime",
         "Check the address manifest (every static buffer, static input and frozen argument) before "
         "every replay, not only the first replay of each graph; a change raises `ReplayError`."),
    Knob("graph_backend", "GRAPHCTL_BACKEND", _parse_choice("auto", "cuda", "emulated"), "auto", "runtime",
         "What `backend=\"auto\"` picks for `@graphed`: `auto` (CUDA graphs when the inputs are on a CUDA "
         "device, else the emulated recorder), `cuda` or `emulated`. An explicit `backend=` wins."),
    Knob("paged_attention", "GRAPHCTL_PAGED_ATTENTION", _parse_choice("auto", "triton", "reference"), "auto",
         "runtime",
         "The CUDA kernel of `graphctl::paged_attention` (the HF engine's attention): `auto` (the Triton kernel "
         "where Triton imports, else the pure-PyTorch reference), `triton` (an error without Triton) or "
         "`reference` (gather the pages, attend under a mask). Other devices always run the reference."),
    Knob("eager_kernels", "GRAPHCTL_EAGER_KERNELS", _parse_bool, True, "runtime",
         "An uncompiled HF model run eagerly with nothing watching its ops (no dispatch mode, no compile trace, "
         "no capture: the default prefill, eager steps) launches each layer's K/V write and paged attention as "
         "two Triton kernels directly, skipping the dispatcher and a dozen small ops a layer; `0` runs them "
         "through the ops, as warmups, captures and compiled models always do."),
    Knob("sampling", "GRAPHCTL_SAMPLING", _parse_choice("auto", "triton", "reference"), "auto", "runtime",
         "Sampling's CUDA kernels: the filtering (host settings with top-k off, or each row's own temperature, "
         "top-k and top-p; vocabularies up to 32,768), the keyed noise, the race and speculative acceptance: "
         "`auto` (Triton, where Triton imports and builds, else the reference), `triton` (an error "
         "without Triton) or `reference` (PyTorch: sort and scan, a dozen small kernels for the acceptance). "
         "Other devices, other settings and larger vocabularies always run the reference."),
    Knob("graphed_recompute", "GRAPHCTL_GRAPHED_RECOMPUTE", _parse_bool, True, "runtime",
         "Replay a write's derived-buffer recompute from one CUDA graph, captured the second time the same chain "
         "runs over the same tensors (`graphctl/state/chains.py`): one launch instead of one per op between "
         "steps. Chains with a non-tensor input, on other devices or inside a capture always run op by op; `0` "
         "runs every chain op by op."),
    Knob("no_extension", "GRAPHCTL_NO_EXTENSION", _parse_bool, False, "runtime",
         "Do not load `graphctl._C`; every op runs its pure-PyTorch reference. `graphctl info` "
         "reports the reason."),
    Knob("native_switch", "GRAPHCTL_NATIVE_SWITCH", _parse_bool, True, "runtime",
         "Run eager, replay and refresh switches as one `graphctl._C` call per direction (a `SwitchTable` built "
         "at a phase's first switch). 0: the Python steps, the reference the native switch is tested against."),
    Knob("build_cuda", "GRAPHCTL_BUILD_CUDA", _parse_choice("auto", "0", "1"), "auto", "build",
         "`auto`: build the CUDA kernels when torch has CUDA, the machine has an NVIDIA driver or "
         "GPU, and a toolkit of torch's CUDA major version is found (else one line says why, and "
         "the CPU kernels are built); `1`: require them, GPU or not (the build fails, saying why; "
         "CI sets it where nvcc exists); `0`: CPU-only build."),
    Knob("cuda_home", "CUDA_HOME", str, "", "build",
         "The CUDA toolkit to build the kernels with (torch's own variable). Unset: `setup.py` "
         "searches the real directory of `nvcc` on `PATH`, `/usr/local/cuda`, then `/usr/local/cuda-*`, "
         "and takes the first with nvcc, `cuda_runtime.h` and `libcudart`; set: only it."),
    Knob("arch_list", "TORCH_CUDA_ARCH_LIST", str, "9.0a;10.0a", "build",
         "CUDA architectures to compile for (torch's own variable); graphctl's default targets "
         "H100/H200 (`9.0a`) and B200 (`10.0a`)."),
    Knob("compile_cache", "GRAPHCTL_COMPILE_CACHE", str, "", "runtime",
         "A directory for torch's compile caches (Inductor's FX-graph and AOTAutograd caches, Triton's kernels), set "
         "as `TORCHINDUCTOR_CACHE_DIR` and `TRITON_CACHE_DIR` (overriding them) before graphctl warms up a "
         "compiled forward: a second process compiling the same models finds their artifacts there (the report says "
         "how many of each bucket's graphs came from the cache). Empty: torch's own default "
         "(`/tmp/torchinductor_<user>`), which a second process on the same machine also reuses."),
    Knob("check_paths", "GRAPHCTL_CHECK_PATHS", _parse_bool, True, "runtime",
         "Before every replay, re-resolve the paths (an argument's attribute, `self.…`, a closure cell, a named "
         "global) to the tensors the capture read or wrote that graphctl does not own, and raise `ReplayError` "
         "naming one that was rebound: metadata, weights (`lin.weight = ...`, `.data = ...`), a replaced module, "
         "and every declared entry of the bound state (tensors by address, objects such as generators by identity). "
         "0 turns it off."),
    Knob("check_outputs", "GRAPHCTL_CHECK_OUTPUTS", _parse_bool, False, "runtime",
         "Return outputs as views that raise `ReplayError` (not the default check's `RuntimeError`) when read "
         "after a later call of the same bucket overwrote them, naming both calls' lines. Debug only: every torch "
         "op on an output pays a Python check."),
    Knob("bypass_window", "GRAPHCTL_BYPASS_WINDOW", int, 64, "runtime",
         "A runner with graphs whose last this-many calls all ran eagerly logs one warning (and `report()` says "
         "`bypassed`): captured graphs that serve nothing are a silent slowdown. 0 turns the warning off."),
    Knob("hypothesis_profile", "GRAPHCTL_HYPOTHESIS_PROFILE", _parse_choice("ci", "thorough", "dev"),
         "ci", "test",
         "Hypothesis profile for `graphctl.testing`'s machines and `tests/property`: `ci` (200 examples "
         "x 30 steps), `thorough` (2000 x 60, for the GPU machine or a night run), `dev` (20 x 10). "
         "Registered as `graphctl-<name>`; in any pytest run with graphctl installed, setting it loads it."),
    Knob("test_seed", "GRAPHCTL_TEST_SEED", int, -1, "test",
         "This repository's tests: the seed of every test's random inputs (the `gen` fixture and torch's, "
         "Python's global generators). -1: a fresh seed per test, printed with a failure as the line "
         "that reproduces it (`GRAPHCTL_TEST_SEED=<seed> pytest <test>`)."),
)


class _Knobs:
    """Attribute access to the parsed values (a dict lookup, cheap enough for hot paths)."""

    __slots__ = ("_values", "_given")

    def __init__(self) -> None:
        values: dict[str, Any] = {}
        given = set()
        for knob in KNOBS:
            raw = os.environ.get(knob.env)
            if raw is None:
                values[knob.attr] = knob.default
                continue
            given.add(knob.attr)
            try:
                values[knob.attr] = knob.parse(raw)
            except ValueError as exc:
                raise ValueError(f"environment variable {knob.env}: {exc}") from None
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_given", frozenset(given))

    def given(self, name: str) -> bool:
        """Whether the environment set this knob (rather than its default applying)."""
        if name not in self._values:
            raise AttributeError(f"no graphctl knob named {name!r}")
        return name in self._given

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"no graphctl knob named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("graphctl knobs are read-only; use graphctl.knobs.scope(...)")

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def live(self) -> Mapping[str, Any]:
        """The values themselves, as a read-only mapping that ``scope`` updates in place: hot paths
        keep it and read ``live["check_stale"]`` (a dict read; an attribute goes through
        ``__getattr__``, about 1 us)."""
        return self._values


knobs = _Knobs()


@contextlib.contextmanager
def scope(**overrides: Any) -> Iterator[None]:
    """Override knobs for a region: ``with graphctl.knobs.scope(check_stale=True): ...``."""
    values = knobs._values
    unknown = sorted(set(overrides) - set(values))
    if unknown:
        raise AttributeError(f"no graphctl knob named {unknown[0]!r}; known: {sorted(values)}")
    saved = {k: values[k] for k in overrides}
    values.update(overrides)
    try:
        yield
    finally:
        values.update(saved)


def env_of(attr: str) -> str:
    """The environment variable of the knob named ``attr``."""
    for k in KNOBS:
        if k.attr == attr:
            return k.env
    raise AttributeError(f"no graphctl knob named {attr!r}")


def markdown_table() -> str:
    rows = ["| variable | when | default | meaning |", "|---|---|---|---|"]
    for k in KNOBS:
        default = k.default if not isinstance(k.default, bool) else int(k.default)
        rows.append(f"| `{k.env}` | {k.when} | `{default}` | {k.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
