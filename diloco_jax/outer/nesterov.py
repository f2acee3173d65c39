"""The outer optimizer's step in numpy, in place and in float32: SGD with Nesterov momentum, delayed so that
the momentum moves once per full round of work however many rounds that work arrives in.

A round that holds a full round's share of the learners' work takes the plain Nesterov step,
m <- mu m + g, theta <- theta - lr (g + mu m). A partial round (e.g. one learner of four under K = 1)
applies its gradient part -lr g at once and adds g to a pending sum; when the pending rounds add up to a
full share (`merge.share_after`), the momentum moves once with their sum, m <- mu m + sum g, and
theta <- theta - lr mu m. So the outer trajectory does not depend on how a period of work is split into
rounds, and a stale single-learner gradient is not amplified through the momentum at every round
(delayed Nesterov momentum, as in asynchronous Local-SGD). The reference these steps are tested against is
the optax optimizer of `tools/bench/outer_reference.py`.
"""

from __future__ import annotations

import numpy as np


def delayed_nesterov_step_(global_vec: np.ndarray, momentum: np.ndarray, grad: np.ndarray, lr: float, mu: float,
                           *, opened: bool = False, full: bool = True, out: np.ndarray | None = None) -> None:
  """The delayed Nesterov step (module docstring) in place, in float32, with its pending sum folded into
  the momentum vector (no extra fragment-sized buffer). A cycle of work opens with its first round, which
  takes m <- mu m + g as the plain step does; the rounds after it in the same cycle (`opened`) add,
  m <- m + g; so once the cycle's shares add up to a full round, m = mu m_before + sum g, the optimizer's
  momentum. The round that completes it (`full`) steps with it, global <- global - lr (g + mu m); a
  partial round applies its gradient alone, global <- global - lr g. The defaults (a new cycle, full) are
  the plain Nesterov step, m <- g + mu m; global <- global - lr (g + mu m): the operations optax's
  `sgd(nesterov=True)` performs (trace, then scale by -lr, then add), in the same order. In between, the
  stored momentum is the optimizer's momentum times mu plus the pending sum (the reference's
  `OuterState.trace`, `.pending`): what the next full round needs. `out`: an optional float32 work array of
  grad's size (else one is allocated); `grad` is kept."""
  mu, lr = np.float32(mu), np.float32(lr)
  tmp = np.empty_like(grad) if out is None else out
  if not opened:
    np.multiply(momentum, mu, out=momentum)
  np.add(momentum, grad, out=momentum)
  if full:
    np.multiply(momentum, mu, out=tmp)
    np.add(tmp, grad, out=tmp)
  else:
    np.copyto(tmp, grad)
  np.multiply(tmp, lr, out=tmp)
  np.subtract(global_vec, tmp, out=global_vec)
