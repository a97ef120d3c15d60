"""Batch layouts that the core and the backends both read (numpy only, no framework).

Below ``rl/``, ``rewards/`` and ``backends/``: the core builds batches in these layouts and
each backend's model reads them, so neither side imports the other for them.

- :mod:`strop.batch.packing`: rollout rows packed end to end (segment ids, positions,
  shared prompt prefixes, ``PREFIX_STRIDE``), the plan both backends' forwards follow;
- :mod:`strop.batch.reward_rows`: a reward model's input rows (its text of a
  (prompt, response) pair, right padding, the pooled column).
"""
