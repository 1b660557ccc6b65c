"""One test per row of docs/errors.md: each bad input raises its typed error with a message
that names the buffer (where there is one), what was expected, what was found, and the fix."""
from __future__ import annotations

import pathlib
import pickle

import pytest
import torch

from support.errors import CASES, PINNED_MESSAGE, table

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_row(case):
    if case.needs_cuda and not torch.cuda.is_available():
        pytest.skip("this error exists only for CUDA states (tests/cuda covers it on the GPU machine)")
    with pytest.raises(case.exc) as ei:
        case.run()
    e = ei.value
    assert type(e) is case.exc, f"expected exactly {case.exc.__name__}, got {type(e).__name__}"
    msg = str(e)
    assert "Fix:" in msg and e.fix, msg
    if e.expected is not None or e.found is not None:
        assert "expected" in msg and "found" in msg, msg
    if e.buffer:
        assert e.buffer.split(",")[0] in msg
    if case.needs_cuda:
        assert msg == PINNED_MESSAGE
    clone = pickle.loads(pickle.dumps(e))
    assert type(clone) is type(e) and str(clone) == msg


def test_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def test_errors_doc_is_current():
    assert DOC.read_text() == table(), (
        "docs/errors.md is stale: run `PYTHONPATH=tests python -m support.errors > docs/errors.md`")
