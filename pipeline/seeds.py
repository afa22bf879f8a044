"""Every random stream of a run, seeded from the run's seed by numpy's ``SeedSequence``.

A stream is named by the run's seed, what it is for (``ORDER``, ``AUGMENT``, ...) and its position
(epoch, image, rank): ``SeedSequence`` hashes the whole key, so nearby keys give unrelated streams and
two purposes never share one (hand-mixed arithmetic such as ``seed * prime + epoch`` collides).
"""

from __future__ import annotations

import numpy as np

# what a stream is for: the second element of every key
ORDER, AUGMENT, DROPOUT, BALANCE = range(4)


def derive_seed(seed: int, purpose: int, *position: int) -> int:
    """A seed in [0, 2**31) for the stream of ``purpose`` at ``position``, e.g. (seed, ORDER, epoch)."""
    return int(np.random.SeedSequence([seed, purpose, *position]).generate_state(1)[0] >> 1)
