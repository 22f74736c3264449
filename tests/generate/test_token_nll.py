"""`perplexity.token_nll`: -log softmax(logits)[target] per row in float64, against torch's cross-
entropy in float64, whichever way the logits lie in memory (a prefill's are the transpose of the
device's `[V, T]` output, so the vocabulary is their outer axis)."""

import numpy as np
import pytest

from anelm.generate.perplexity import token_nll

torch = pytest.importorskip("torch")


def test_token_nll_is_float64_cross_entropy_for_either_layout():
    rng = np.random.default_rng(0)
    device_out = (rng.standard_normal((50000, 17)) * 6).astype(np.float16).astype(np.float32)  # [V, T]
    logits = device_out.T[:-1]                          # [T-1, V], vocabulary outer, as a prefill gives it
    assert logits.strides[0] < logits.strides[1]
    targets = rng.integers(0, 50000, len(logits))
    want = torch.nn.functional.cross_entropy(torch.from_numpy(logits.astype(np.float64)),
                                             torch.from_numpy(targets), reduction="none").numpy()
    for layout in (logits, np.ascontiguousarray(logits)):
        got = token_nll(layout, targets)
        assert got.dtype == np.float64 and got.shape == (16,)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-11)  # float64 sums of 50k terms in another order
